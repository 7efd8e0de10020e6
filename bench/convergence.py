"""Convergence benchmark: DMuon (Muon on the blocks' matrices, AdamW on the rest) against
AdamW on every parameter, on the built-in ``small`` model (d=256, 4 layers, vocab 256)
and the standard library's sources read byte-level (the built-in corpus; validation is
every 20th file). Each optimizer's learning rate is tuned on a small grid at seed 0;
the best is then run at more seeds. Same tokens, same seeds, same schedule (10% warmup,
cosine to 0.1), clipping at 1.0, fp32. Each run is one process (a 1-rank mesh for DMuon,
so its hooks and partition run; a plain module for AdamW) on the machine's cores.

AdamW is also run LONGER times as many steps (its schedule stretched to them, same LR and
seeds) to find the step at which it reaches DMuon's final loss. Wall time is the training
steps' own (set-up and validation left out). Prints a table, writes
bench/results/convergence.json and bench/figures/convergence.png (validation loss against
steps and against wall time). Not a test: what was measured is reported, whatever it is.

    python -m bench.convergence [--steps 200] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

RESULTS = pathlib.Path(__file__).parent / "results"
FIGURE = pathlib.Path(__file__).parent / "figures" / "convergence.png"  # the README shows it
MUON_GRID = (0.02, 0.04, 0.08)  # Muon's lr; AdamW's part (embeddings, head, norms) 3e-3
ADAMW_GRID = (5e-4, 1e-3, 2e-3, 4e-3)
SEQ, BATCH, VAL_EVERY, VAL_BATCHES = 64, 8, 20, 8
LONGER = 4


def _spec(optimizer: str, lr: float, steps: int, seed: int) -> dict:
    return {"model": "small", "steps": steps, "batch_size": BATCH, "seq_len": SEQ,
            "precision": "float32", "clip_grad_norm": 1.0, "seed": seed,
            "schedule": {"warmup_steps": steps // 10, "decay": "cosine", "min_lr_ratio": 0.1},
            "optimizer": {"lr": lr if optimizer == "dmuon" else 0.02, "adamw_lr":
                          3e-3 if optimizer == "dmuon" else lr, "weight_decay": 0.0,
                          "ns_dtype": "float32", "ns_backend": "standard"},
            "data": {"val_every": VAL_EVERY, "val_batches": VAL_BATCHES},
            "layout": {"replicate": 1, "shard": 1}}


def _dmuon_run(rank, world, spec_data):
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.worker.loop import run_training

    torch.set_num_threads(2)
    curve, clock = [], [0.0]

    def report(record, _path):  # time: the training steps' own (no set-up, no validation)
        clock[0] += record["step_time_s"]
        if "val_loss" in record:
            curve.append((record["step"], clock[0], record["val_loss"]))

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    run_training(Job.local(spec_data, plan_on_one_host(spec_data)), mesh, report)
    return curve


def _adamw_run(rank, world, spec_data):
    """The same loop (data, schedule, clipping, validation) with torch.optim.AdamW on
    every parameter of a plain module."""
    from service.job.models.builtin import build_model, causal_lm_loss
    from service.job.spec import parse_spec
    from service.worker.batches import Batches
    from service.worker.loop import BUILTIN_INPUTS
    from service.worker.training_recipe import lr_factor

    torch.set_num_threads(2)
    spec = parse_spec(spec_data)
    model = build_model(spec.llama_config(), seed=spec.seed)
    o = spec.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.adamw_lr, betas=o.adamw_betas,
                            eps=o.adamw_eps, weight_decay=0.0)
    train = Batches(BUILTIN_INPUTS["data"], "train", SEQ, spec.seed, 0.05)
    val = Batches(BUILTIN_INPUTS["data"], "val", SEQ, spec.seed, 0.05)
    curve, clock = [], 0.0
    for step in range(spec.steps):
        start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = o.adamw_lr * lr_factor(spec, step)
        rows = train.rows(step, BATCH, 0, 1)
        causal_lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip_grad_norm)
        opt.step()
        opt.zero_grad()
        clock += time.perf_counter() - start
        if (step + 1) % VAL_EVERY == 0:
            with torch.no_grad():
                losses = [causal_lm_loss(model(r[:, :-1]), r[:, 1:]).item() for r in
                          (val.rows(i, BATCH, 0, 1) for i in range(VAL_BATCHES))]
            curve.append((step + 1, clock, sum(losses) / len(losses)))
    return curve


def run_one(optimizer: str, lr: float, steps: int, seed: int) -> list:
    from dmuon.testing import run

    fn = _dmuon_run if optimizer == "dmuon" else _adamw_run
    return run(fn, _spec(optimizer, lr, steps, seed), world_size=1)[0]


def steps_to_reach(curve: list, target: float) -> int | None:
    return next((step for step, _, loss in curve if loss <= target), None)


def mean_curve(curves: list[list]) -> list:
    return [(c[0][0], statistics.mean(x[1] for x in c), statistics.mean(x[2] for x in c))
            for c in zip(*curves)]


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, color in (("dmuon", "tab:blue"), ("adamw", "tab:orange")):
        best = results[name]
        for curve in best["curves"]:
            axes[0].plot([c[0] for c in curve], [c[2] for c in curve], color=color, alpha=0.3)
            axes[1].plot([c[1] for c in curve], [c[2] for c in curve], color=color, alpha=0.3)
        mean = best["mean"]
        label = f"{name} (lr {best['lr']:g}, mean of {len(best['curves'])} seeds)"
        axes[0].plot([c[0] for c in mean], [c[2] for c in mean], color=color, label=label)
        axes[1].plot([c[1] for c in mean], [c[2] for c in mean], color=color, label=label)
    longer = results["adamw_longer"]["mean"]
    label = f"adamw, {results['adamw_longer']['steps']} steps (schedule stretched)"
    axes[0].plot([c[0] for c in longer], [c[2] for c in longer], color="tab:orange",
                 linestyle="--", label=label)
    axes[1].plot([c[1] for c in longer], [c[2] for c in longer], color="tab:orange",
                 linestyle="--", label=label)
    target = results["dmuon"]["mean"][-1][2]
    for ax in axes:
        ax.axhline(target, color="tab:blue", linestyle=":", linewidth=1)
    for ax, xlabel in zip(axes, ("step", "wall time of the training steps (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("built-in small model, stdlib sources (bytes): DMuon vs AdamW")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    results: dict = {"steps": args.steps, "tokens_per_step": BATCH * SEQ, "grid": {}}
    t0 = time.time()
    for name, grid in (("dmuon", MUON_GRID), ("adamw", ADAMW_GRID)):
        grid_curves = {lr: run_one(name, lr, args.steps, 0) for lr in grid}
        results["grid"][name] = {str(lr): c[-1][2] for lr, c in grid_curves.items()}
        lr = min(grid_curves, key=lambda k: grid_curves[k][-1][2])
        curves = [grid_curves[lr]] + [run_one(name, lr, args.steps, s)
                                      for s in range(1, args.seeds)]
        results[name] = {"lr": lr, "curves": curves, "mean": mean_curve(curves)}
        print(f"{name}: grid {results['grid'][name]} -> lr {lr:g}", flush=True)
    target = results["dmuon"]["mean"][-1][2]
    results["adamw_steps_to_dmuon_final"] = steps_to_reach(results["adamw"]["mean"], target)
    # AdamW given LONGER x the steps (its schedule stretched to them), same LR and seeds:
    # where it reaches DMuon's final loss
    long_steps = args.steps * LONGER
    longer = [run_one("adamw", results["adamw"]["lr"], long_steps, s) for s in range(args.seeds)]
    results["adamw_longer"] = {"steps": long_steps, "curves": longer,
                               "mean": mean_curve(longer),
                               "reaches_at": steps_to_reach(mean_curve(longer), target)}
    results["bench_seconds"] = round(time.time() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "convergence.json").write_text(json.dumps(results, indent=1))
    plot(results, FIGURE)
    print(table(results))


def table(results: dict) -> str:
    lines = ["| optimizer | lr (grid winner) | final val loss (mean, min-max over seeds) | "
             "wall time (s, mean) |", "|---|---:|---:|---:|"]
    for name in ("dmuon", "adamw"):
        r = results[name]
        finals = [c[-1][2] for c in r["curves"]]
        lines.append(f"| {name} | {r['lr']:g} | {statistics.mean(finals):.4f} "
                     f"({min(finals):.4f}-{max(finals):.4f}) | {r['mean'][-1][1]:.0f} |")
    target, steps = results["dmuon"]["mean"][-1][2], results["steps"]
    reach, longer = results["adamw_steps_to_dmuon_final"], results["adamw_longer"]
    lines.append(f"\nDMuon's final mean val loss {target:.4f} after {steps} steps. AdamW "
                 + (f"reaches it at step {reach}" if reach else f"does not within {steps}")
                 + f"; run for {longer['steps']} steps (schedule stretched), it ends at "
                 f"{longer['mean'][-1][2]:.4f} and "
                 + (f"reaches it at step {longer['reaches_at']} "
                    f"({longer['reaches_at'] / steps:.2f}x DMuon's steps)"
                    if longer["reaches_at"] else "does not reach it"))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
