"""``bench.gpu``'s CPU form (issue 42, item 7): ``python -m bench.gpu --device cpu --tiny``
runs every check of the single-GPU bench on gloo at world size 1, and its record says
what each measured. The bench runs once (about 8 s on 2 cores); each test reads its JSON.

Known values are counted by hand from the tiny preset (vocab 256, dim 64, 2 layers, 4
heads of 16, 2 KV heads, FFN 128): 106,816 parameters (tests/control/test_cli.py shows the sum);
a block's Muon matrices hold 2*64*64 (q, o) + 2*32*64 (k, v) + 3*128*64 (MLP) = 36,864
elements, 147,456 bytes in fp32.

The NS bounds: fp32's unit roundoff is 6e-8 and bf16's 3.9e-3; five quintic iterations
amplify rounding by a few tens (measured here: fp32 1.2e-6 to 1.6e-6, bf16 1.2e-2 to
2.7e-2 at these shapes), so a correct fp32 NS stays far below 1e-4 and bf16 below 5e-2,
at every scale (their exponent range covers 1e-12 to 1e3 times a norm of 1e5). fp16 has
11 bits (unit roundoff 4.9e-4; 1.6e-3 to 3.3e-3 measured where nothing under- or
overflows), but only 5 exponent bits: it holds the normalised iterate, not the raw
gradient, whose elements underflow at 1e-8 (below fp16's 6e-8) and lose most bits at
1e-6, and whose norm overflows at 1e3 (1.3e5 > 65,504). Issue 42 asks that NS normalise
before it casts; then fp16 stays within 2e-2 at every scale.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from helpers.paths import ROOT

from bench.gpu_ns import BACKENDS, DTYPES, SCALES, SHAPES
from service.job.models.builtin import get_config, num_params

CHECKS = {"ns_error", "stream_race", "compile", "memory", "step_time", "experts_backward",
          "max_logit"}
TINY_PARAMS = 106_816
BLOCK_MUON_BYTES = 4 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)
FP16_BOUND = 2e-2
EXTREME = (1e-8, 1e-6, 1e3)  # where fp16 cast before normalising under- or overflows


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> tuple[dict, str, str]:
    """The JSON, the printed output and the Markdown record of one run."""
    out = tmp_path_factory.mktemp("bench_gpu")
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu", "--tiny"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [data_file] = out.glob("gpu_*.json")
    [table_file] = out.glob("gpu_*.md")
    return json.loads(data_file.read_text()), proc.stdout, table_file.read_text()


def _errors(data, dtype: str, scales) -> dict:
    return {(tuple(r["shape"]), r["backend"], r["scale"]): r["rel_error"]
            for r in data["checks"]["ns_error"] if r["dtype"] == dtype and r["scale"] in scales}


def test_every_check_ran_and_every_row_is_in_the_record(record):
    data, printed, markdown = record
    assert data["bench"] == "gpu" and data["device"] == "cpu" and data["world_size"] == 1
    assert set(data["checks"]) == CHECKS
    assert [c for c, r in data["checks"].items() if "error" in r] == []
    rows = {(tuple(r["shape"]), r["backend"], r["dtype"], r["scale"])
            for r in data["checks"]["ns_error"]}
    assert len(data["checks"]["ns_error"]) == len(rows) == 2 * 2 * 3 * 8
    assert {s for s, *_ in rows} == set(SHAPES["cpu"]) and len(SCALES) == 8
    assert SCALES[0] == 1e-12 and SCALES[-1] == 1e3
    assert {b for _, b, _, _ in rows} == set(BACKENDS) == {"standard", "gram"}
    assert {d for *_, d, _ in rows} == {str(d)[6:] for d in DTYPES}
    for line in ("| check | case | measured | verdict |", "| NS error vs float64 | 64x256 gram "
                 "float16 |", "| stream race", "| compile vs eager |", "| CUDA graphs under Z3 |",
                 "| memory_report vs allocator | model.layers.0 gather |", "| step time |",
                 "| experts backward |", "| QK-clip max logits | fallback"):
        assert line in printed and line in markdown, line


def _quintic_float64(G: torch.Tensor) -> torch.Tensor:
    """Keller Jordan's quintic NS, 5 steps, written out here in float64."""
    X = G.double()
    X = X / X.norm()
    for _ in range(5):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X


def test_the_float64_reference_is_newton_schulz():
    import dmuon

    G = torch.randn(64, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mine = _quintic_float64(G)
    for backend in BACKENDS:  # Gram NS is the same polynomial, computed on X Xᵀ
        ref = dmuon.newton_schulz(G, backend=backend, dtype=torch.float64)
        assert float((ref - mine).norm() / mine.norm()) < 1e-10, backend


def test_fp32_and_bf16_ns_errors_stay_within_their_rounding_at_every_scale(record):
    data = record[0]
    fp32, bf16 = _errors(data, "float32", SCALES), _errors(data, "bfloat16", SCALES)
    assert len(fp32) == len(bf16) == 32
    assert {k: e for k, e in fp32.items() if not e < 1e-4} == {}
    assert {k: e for k, e in bf16.items() if not e < 5e-2} == {}
    assert min(bf16.values()) > 1e-3  # bf16 was really used: above fp32's error


def test_fp16_ns_error_within_2e_2_at_moderate_scales(record):
    data = record[0]
    errors = _errors(data, "float16", (1e-4, 1e-2, 1.0))
    assert len(errors) == 12
    assert {k: e for k, e in errors.items() if not e < FP16_BOUND} == {}


def test_fp16_ns_error_within_2e_2_at_1e_8_1e_6_and_1e3(record):
    """Fails before issue 42's NS fix: cast to fp16 before the norm, 1e-8 underflows
    (error 1.1), 1e-6 keeps few bits (2.0e-2 to 2.2e-2) and at 1e3 the norm overflows
    to inf (output zero: error 1.0)."""
    data = record[0]
    errors = _errors(data, "float16", EXTREME)
    assert len(errors) == 12
    assert {k: e for k, e in errors.items() if not e < FP16_BOUND} == {}


def test_stream_race_is_not_applicable_on_cpu_and_its_hook_runs(record):
    r = record[0]["checks"]["stream_race"]
    assert r["applicable"] is False and r["consumer_waits"] is None
    assert "not applicable on cpu" in r["note"]
    # entered for each block's forward gather, backward re-gather and reduce, 4 steps
    assert r["delays_queued"] >= 4 * 2 * 3
    losses = r["losses"]
    assert len(losses["plain"]) == 4 and all(math.isfinite(v) for v in losses["plain"])
    # no streams on the CPU: the three runs compute the same thing
    assert losses["side_stream_delayed"] == losses["plain_again"] == losses["plain"]
    assert r["max_rel_diff"] == r["noise"] == 0.0


def test_block_compile_matches_eager_on_cpu_and_cuda_graphs_are_not_applicable(record):
    r = record[0]["checks"]["compile"]
    compiled = r["block_compile_z3"]
    assert compiled["compile"] == {"backend": "eager"} and compiled["z3"] is True
    assert compiled["counters"]["unique_graphs"] >= 1  # dynamo traced the blocks
    assert compiled["max_rel_diff"] <= 1e-6
    assert compiled["losses"] == pytest.approx(r["eager_z3"]["losses"], rel=1e-6)
    for name, z3 in (("reduce_overhead_z2", False), ("reduce_overhead_z3", True)):
        assert r[name]["z3"] is z3 and r[name]["compile"] == {"mode": "reduce-overhead"}
        assert r[name]["note"] == "not applicable on cpu: CUDA graphs"


def test_memory_report_counts_one_block_gathered_and_freed(record):
    r = record[0]["checks"]["memory"]
    assert r["boundary"] == "model.layers.0"
    assert r["expected_bytes"] == BLOCK_MUON_BYTES == 147_456
    assert r["gather"] == {"report_delta": BLOCK_MUON_BYTES, "allocated_delta": None}
    assert r["free"] == {"report_delta": -BLOCK_MUON_BYTES, "allocated_delta": None}


def test_step_time_compares_dmuon_with_fsdp2_adamw(record):
    r = record[0]["checks"]["step_time"]
    assert r["params"] == TINY_PARAMS == num_params(get_config("tiny"))
    assert r["tokens_per_step"] == 2 * 16 and r["timed"] == 2
    for name in ("dmuon_z3", "fsdp2_adamw"):
        assert len(r[name]["steps_s"]) == 2 and all(t > 0 for t in r[name]["steps_s"])
        assert sorted(r[name]["steps_s"])[0] <= r[name]["step_s"] <= max(r[name]["steps_s"])
        assert all(math.isfinite(v) and 0 < v < 10 for v in r[name]["losses"])
    assert r["dmuon_over_fsdp2_adamw"] == pytest.approx(
        r["dmuon_z3"]["step_s"] / r["fsdp2_adamw"]["step_s"])
