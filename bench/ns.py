"""Newton-Schulz benchmark: CPU time of Gram vs standard vs torch.optim.Muon's NS, and
singular-value accuracy against float64 on random and training-gradient matrices.

Prints two tables and writes bench/results/ns.json. Single thread, one process.
"""

from __future__ import annotations

import functools
import json
import pathlib
import statistics
import time

import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import dmuon
from service.train.corpus import batch_at, load_corpus
from service.train.models import ModelConfig, build_model, causal_lm_loss

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


def timing() -> list[dict]:
    rows = []
    for shape in SHAPES:
        G = torch.randn(*shape)
        for dtype in (torch.float32, torch.bfloat16):
            row = {"shape": list(shape), "dtype": str(dtype)}
            for backend in ("gram", "standard"):
                row[backend] = _time(functools.partial(dmuon.newton_schulz, G,
                                                       backend=backend, dtype=dtype))
            if dtype == torch.float32:  # the option: the m x m iteration promoted to fp64
                row["gram_fp64_iteration"] = _time(functools.partial(
                    dmuon.newton_schulz, G, dtype=dtype, gram_dtype=torch.float64))
            else:  # torch's NS always runs in bf16
                row["torch"] = _time(functools.partial(_zeropower_via_newtonschulz, G,
                                                       (3.4445, -4.7750, 2.0315), 5, 1e-7))
            row["gram_over_standard"] = row["gram"] / row["standard"]
            row["flop_ratio"] = dmuon.ns_flops(shape, 5, "gram") / dmuon.ns_flops(
                shape, 5, "standard")
            rows.append(row)
    return rows


def training_gradients(ratios=(1, 2, 4, 8)) -> dict[int, torch.Tensor]:
    """up_proj gradients (aspect ratio r) after a few AdamW steps on the built-in corpus."""
    grads, corpus = {}, load_corpus("train", max_bytes=300_000)
    for r in ratios:
        cfg = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_dim=64 * r, max_seq_len=64)
        model = build_model(cfg, seed=r)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(6):
            opt.zero_grad()
            tokens = batch_at(corpus, step, 8, 64)
            causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            if step < 5:
                opt.step()
        grads[r] = model.model.layers[1].mlp.up_proj.weight.grad.detach().double().clone()
    return grads


def _sigma_error(G, backend, dtype, coefficients, **gram) -> float:
    exact = torch.linalg.svdvals(dmuon.newton_schulz(G, backend="standard", dtype=torch.float64,
                                                     coefficients=coefficients))
    out = dmuon.newton_schulz(G, backend=backend, dtype=dtype, coefficients=coefficients,
                              **gram)
    return (torch.linalg.svdvals(out.double()) - exact).abs().max().item()


# the first Gram version: no restart, m x m iteration only promoted to fp32
_PLAIN_GRAM = {"restart": False, "gram_dtype": torch.float32}


def accuracy(seeds: int = 8) -> list[dict]:
    """Gram / standard error; on random matrices the sums over ``seeds`` matrices (one
    matrix's ratio scatters), on each training gradient alone."""
    rows, grads = [], training_gradients()
    for source in ("random", "gradient"):
        for r, grad in grads.items():
            mats = [torch.randn(64, 64 * r, dtype=torch.float64,
                                generator=torch.Generator().manual_seed(100 * r + i))
                    for i in range(seeds)] if source == "random" else [grad]
            for dtype in (torch.bfloat16, torch.float32):
                for coef in ("quintic", "polar_express"):
                    s, g, p = (sum(_sigma_error(G, b, dtype, coef, **kw) for G in mats)
                               for b, kw in (("standard", {}), ("gram", {}),
                                             ("gram", _PLAIN_GRAM)))
                    rows.append({"source": source, "ratio": r, "dtype": str(dtype),
                                 "coefficients": coef, "gram": g, "standard": s,
                                 "plain_gram": p, "gram_over_standard": g / s,
                                 "plain_gram_over_standard": p / s})
    return rows


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    times, acc = timing(), accuracy()
    print("| shape | dtype | gram (ms) | gram, fp64 m x m (ms) | standard (ms) |"
          " torch Muon NS (ms) | gram/standard | FLOP ratio |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for r in times:
        ms = {k: f"{r[k] * 1e3:.0f}" if k in r else "-"
              for k in ("gram_fp64_iteration", "torch")}
        print(f"| {r['shape'][0]}x{r['shape'][1]} | {r['dtype'][6:]} | {r['gram'] * 1e3:.0f} |"
              f" {ms['gram_fp64_iteration']} | {r['standard'] * 1e3:.0f} | {ms['torch']} |"
              f" {r['gram_over_standard']:.2f} | {r['flop_ratio']:.2f} |")
    print("\nmax |σ_i(out) - σ_i(out_fp64)|, Gram / standard (random: sums over 8 matrices);"
          " in brackets the first Gram (no restart, m x m in fp32)\n"
          "| source | aspect | dtype | quintic | polar_express |\n|---|---:|---|---:|---:|")
    for i in range(0, len(acc), 2):
        q, p = acc[i], acc[i + 1]
        print(f"| {q['source']} | {q['ratio']} | {q['dtype'][6:]} |"
              f" {q['gram_over_standard']:.2f} ({q['plain_gram_over_standard']:.2f}) |"
              f" {p['gram_over_standard']:.2f} ({p['plain_gram_over_standard']:.2f}) |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ns.json").write_text(json.dumps({"timing": times, "accuracy": acc}, indent=2))


if __name__ == "__main__":
    main()
