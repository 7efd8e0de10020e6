"""``bench.pp_plan``'s planner tables on a small dense model (4 layers, a few seconds):
every layer in one stage, the bubble (pp-1)/(m+pp-1), the pp bytes one GPU sends per
step m x rows x seq x hidden x 2 bytes / TP each way, and the planner's split no slower
than the split by count or without NS; then the newest committed record's rows against
the same rules (no timing asserts)."""

from __future__ import annotations

import json
import pathlib

import pytest
from helpers import paths

from bench.pp_plan import llama_rows, llama_table, split_table

SMALL = {"vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8,
         "ffn_dim": 128, "max_seq_len": 64}


def _check(r: dict, layers: int) -> None:
    cover = [i for lo, hi in r["split"] for i in range(lo, hi)]
    assert cover == list(range(layers))
    assert r["bubble"] == pytest.approx((r["pp"] - 1) / (r["micro_batches"] + r["pp"] - 1))
    assert r["slowest_s"] <= r["by_count"]["slowest_s"] * (1 + 1e-9)
    assert r["slowest_s"] <= r["without_ns"]["slowest_s"] * (1 + 1e-9)
    assert r["fits"] == (r["peak_bytes"] <= 0.9 * r["device_bytes"])


def test_the_planner_tables_of_a_small_model():
    rows = llama_rows(hosts=2, pps=(1, 2), model=SMALL, rows=16, seq=64)
    assert [r["pp"] for r in rows] == [1, 2]
    for r in rows:
        _check(r, SMALL["n_layers"])
    pp1, pp2 = rows
    assert pp1["pp_bytes"] == 0 and pp1["bubble"] == 0
    # 16 rows over FSDP 1 (2 hosts x 8 GPUs / (TP 8 x PP 2)): 16 micro-batches of 1 row
    assert pp2["micro_batches"] == 16
    assert pp2["pp_bytes"] == 16 * 1 * 64 * SMALL["dim"] * 2 // 8
    assert "PP 2 x TP 8 x FSDP 1" in llama_table(rows)
    assert "0-1 2-3" in split_table(rows[1:]) or "0-2 3-3" in split_table(rows[1:])


def test_the_newest_record_keeps_the_rules():
    records = sorted(pathlib.Path(paths.ROOT, "bench", "results").glob("pp_plan_*.json"))
    data = json.loads(records[-1].read_text())
    for r in data["llama3_405b"]:
        _check(r, 126)
    assert [r["pp"] for r in data["llama3_405b"]] == [1, 4, 8, 16]
    for r in data["kimi_k2_shape"]:
        _check(r, 61)
    fwd = data["measured"][1]["pp_phases_by_rank"][0]["forward"]
    assert fwd == 4 * 2 * 64 * 256 * 4  # m x rows x seq x hidden x fp32
