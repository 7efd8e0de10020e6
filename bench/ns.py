"""Newton-Schulz timing on the CPU: Gram NS as its authors run it (the default: one
restart at iteration 2, the whole iteration in the input's precision) against Gram with
its m x m iteration promoted to fp64 (an option), standard NS, and torch.optim.Muon's NS.

One thread, median of 3 (after one warm-up), ms. fp32 by default; ``--bf16`` adds bf16
rows (emulated on CPUs without bf16 instructions: 3x to 58x slower than fp32 here).
Quality is judged by training, not by one matrix's singular values (bench/ns_quality.py).
Prints a table and writes bench/results/ns.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import time

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import dmuon

SHAPES = ((1024, 1024), (1024, 2048), (1024, 4096), (1024, 8192))
RESULTS = pathlib.Path(__file__).parent / "results"


def _time(fn, repeats=3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timing(dtypes) -> list[dict]:
    rows = []
    for shape in SHAPES:
        G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        for dtype in dtypes:
            ns = functools.partial(dmuon.newton_schulz, G, dtype=dtype)
            row = {"shape": list(shape), "dtype": str(dtype)[6:],
                   "gram": _time(functools.partial(ns, backend="gram")),
                   "standard": _time(functools.partial(ns, backend="standard"))}
            if dtype == torch.float32:
                row["gram_fp64_iteration"] = _time(functools.partial(
                    ns, backend="gram", gram_dtype=torch.float64))
            else:  # torch's NS always runs in bf16
                row["torch"] = _time(functools.partial(_zeropower_via_newtonschulz, G,
                                                       (3.4445, -4.7750, 2.0315), 5, 1e-7))
            row["gram_over_standard"] = row["gram"] / row["standard"]
            row["flop_ratio"] = dmuon.ns_flops(shape, 5, "gram") / dmuon.ns_flops(
                shape, 5, "standard")
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bf16", action="store_true", help="also time bf16 (slow on most CPUs)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = timing([torch.float32] + ([torch.bfloat16] if args.bf16 else []))
    print("| shape | dtype | gram (ms) | gram, fp64 m x m (ms) | standard (ms) |"
          " torch Muon NS (ms) | gram / standard | FLOP ratio |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ms = {k: f"{r[k] * 1e3:.0f}" if k in r else "-"
              for k in ("gram_fp64_iteration", "torch")}
        print(f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['gram'] * 1e3:.0f} |"
              f" {ms['gram_fp64_iteration']} | {r['standard'] * 1e3:.0f} | {ms['torch']} |"
              f" {r['gram_over_standard']:.2f} | {r['flop_ratio']:.2f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ns.json").write_text(json.dumps({"timing": rows}, indent=2))


if __name__ == "__main__":
    main()
