"""``bench.ep_plan``'s record against what can be counted without the planner: each
model's parameters from its config (a Qwen3-MoE counted by hand), every row's ``ep``
bytes per step from the ledger's all-to-all model with routing spread evenly, and the
layout rules (P divides N and the experts, the data-parallel ranks split the batch, the
ep dim on NVLink exactly when P divides a host's GPUs, a row that runs fits 90% of its
device). Checked on a reduced run (Qwen3-30B-A3B up to 8 hosts, a few seconds) and on
the newest committed record."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import paths

from bench.ep_plan import GLOBAL_ROWS, GPUS_PER_HOST, SEQ

ROOT = pathlib.Path(paths.ROOT)
BF16 = 2


def qwen3_moe_params(c: dict) -> int:
    """A Qwen3-MoE's parameters: untied embedding and head, per layer q/k/v/o with
    q/k norms of head_dim, two RMSNorms, and either the router and E experts of
    gate/up/down or a dense SwiGLU MLP; the final norm."""
    H, hd, V = c["hidden_size"], c["head_dim"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    attention = H * heads * hd * 2 + H * kv * hd * 2 + 2 * hd + 2 * H
    dense = set(c.get("mlp_only_layers", []))
    moe = c["num_experts"] * (H + 3 * c["moe_intermediate_size"] * H)
    mlp = 3 * c["intermediate_size"] * H
    layers = sum(attention + (mlp if i in dense else moe)
                 for i in range(c["num_hidden_layers"]))
    return 2 * V * H + layers + H


def ep_bytes(c: dict, P: int, micro_batches: int) -> float:
    """One rank's ``ep`` bytes per step: per MoE layer and micro-batch an all-to-all
    moves (P-1)/P of what a rank puts in: forward the E int64 counts, the SEQ x k rows of
    hidden bf16 out and back; backward their two gradients; the checkpointed forward
    again."""
    if P == 1:
        return 0
    layers = c["num_hidden_layers"] - len(c.get("mlp_only_layers", []))
    rows = SEQ * c["num_experts_per_tok"] * c["hidden_size"] * BF16
    forward = 8 * c["num_experts"] + 2 * rows
    return layers * micro_batches * (P - 1) / P * (2 * forward + 2 * rows)


def check(data: dict) -> None:
    assert (data["global_rows"], data["seq_len"]) == (GLOBAL_ROWS, SEQ)
    rows = [r for r in data["rows"] if "refused" not in r] + data["published"]
    assert rows
    for r in rows:
        c, P = data["configs"][r["model"]], r["ep"]
        R, N = r["layout"]
        assert r["params"] == qwen3_moe_params(c), r["model"]
        assert N % P == 0 and c["num_experts"] % P == 0, r
        assert r["gpus"] == R * N == r["hosts"] * GPUS_PER_HOST, r
        assert r["micro_batches"] * R * N == GLOBAL_ROWS, r
        assert r["ep_link"] == ("NVLink" if GPUS_PER_HOST % P == 0 else "IB"), r
        assert math.isclose(r["bytes_per_step"].get("ep", 0),
                            ep_bytes(c, P, r["micro_batches"]), rel_tol=1e-12), r
        # the worst rank at rest holds at least the average bf16 column, fp32 master and
        # momentum (10 bytes per parameter over the ranks), at its peak the gradient too
        assert r["resident_bytes"] * R * N >= 10 * r["params"], r
        assert r["peak_bytes"] * R * N >= 12 * r["params"], r
        if r.get("kind") != "published":
            assert r["fits"] and r["peak_bytes"] <= 0.9 * r["device_bytes"], r
            assert r["kind"] == ("HSDP" if R > 1 or N == GPUS_PER_HOST else "FSDP"), r


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep_plan")
    env = {**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "bench.ep_plan", "--models", "qwen3-30b-a3b",
                    "--max-hosts", "8"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=120)
    (record,) = out.glob("ep_plan_*.json")
    return json.loads(record.read_text())


def test_a_reduced_run_counts_as_the_formulas_do(reduced):
    assert [r["ep"] for r in reduced["rows"]] == [1, 8, 16, 32, 64]
    check(reduced)
    # P > 8 needs N > 8: the shard group over hosts, the ep dim on InfiniBand
    by_p = {r["ep"]: r for r in reduced["rows"]}
    assert {P: by_p[P]["hosts"] for P in (16, 32, 64)} == {16: 2, 32: 4, 64: 8}


def test_the_committed_record_counts_as_the_formulas_do():
    records = sorted((ROOT / "bench" / "results").glob("ep_plan_*.json"),
                     key=lambda p: p.stem.rsplit("_", 1)[-1])
    if not records:
        pytest.skip("no ep_plan record committed")
    check(json.loads(records[-1].read_text()))
