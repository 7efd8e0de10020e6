"""Convergence of the Muon variants (issue 46, item 5): plain Muon, Muon with QK-clip
(MuonClip, ``dmuon.qk_clip``) and NorMuon (``dmuon.normuon``) on the built-in model.

Every run is ``bench.convergence``'s DMuon run (the service's loop on a 1-rank gloo mesh:
the standard library's sources byte-level, 10% warmup then cosine to 0.1, clipping at
1.0, fp32 with fp32 NS) with the same tokens, seed and schedule; only the optimizer's
options differ. Every run tracks the max logits (``qk_clip``): a run without clipping
uses a tau no logit reaches (``NO_CLIP``), so that the recording is the only difference.

- plain Muon at a high learning rate (``HIGH_LR``), where its max logit grows past tau;
- the same with QK-clip at tau (``TAU``: see there why that value);
- NorMuon (its authors' beta2 = 0.95, eps = 1e-10, arXiv 2510.05491, as
  ``dmuon.normuon`` holds them) against Muon at equal steps, at the normal learning rate
  (``LR``: bench/convergence.py's grid winner) and at the high one.

What a step's ``max_logit`` is: the largest pre-softmax logit of any head in that step's
forward, i.e. of the weights left by the previous step's update and clip. The clip
scales a head's q/k rows so that the max it measured (before the update) becomes tau;
the update of that step may raise it again, so a clipped run's next steps can read a
little over tau: the table counts those steps as they are.

One process at a time, one thread. Prints a table and writes a dated record in
bench/results/. Not a test: what was measured is reported, whatever it is.

    python -m bench.muon_variants [--steps 200] [--preset small]
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

import dmuon
from bench.convergence import BATCH, SEQ
from bench.convergence import _spec as convergence_spec

LR, HIGH_LR = 0.02, 0.2  # Muon's lr; AdamW's part (embeddings, head, norms) 3e-3 always
# The built-in model's logits are small: its max logit starts at 0.47 and, at LR, peaks
# at 19.3 over 200 steps (seed 0), while at HIGH_LR it passes 2,000 (the record of
# 2026-12-04). Kimi K2's tau = 100 is for the logits of large models; 25 is a bit above
# what training at the normal lr reaches, so the clip acts on the growth the high lr
# adds and would leave the normal run alone.
TAU = 25.0
BETA2 = inspect.signature(dmuon.Muon).parameters["beta2"].default
NO_CLIP = 1e9  # the spec's largest tau: no logit of these models comes near it
VAL_EVERY = 20
# (name, variant, lr, tau): a - plain Muon high, b - QK-clip high, c - NorMuon vs Muon
RUNS = (("muon", "muon", LR, NO_CLIP), ("normuon", "normuon", LR, NO_CLIP),
        ("muon-high", "muon", HIGH_LR, NO_CLIP),
        ("muon-high+qk-clip", "muon", HIGH_LR, TAU),
        ("normuon-high", "normuon", HIGH_LR, NO_CLIP))


def spec(preset: str, variant: str, lr: float, tau: float, steps: int, seed: int) -> dict:
    """bench.convergence's DMuon spec with the variant, the tracked max logits and a
    validation every VAL_EVERY steps (and at the last one)."""
    data = convergence_spec("dmuon", lr, steps, seed)
    data["model"] = preset
    data["optimizer"].update(variant=variant, qk_clip={"tau": tau})
    data["data"]["val_every"] = min(VAL_EVERY, steps)
    return data


def _run(rank, world, spec_data):
    """One run on a 1-rank mesh: per step (step, loss, max logit, heads clipped,
    step time, val loss or None)."""
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.worker.loop import run_training

    torch.set_num_threads(1)  # the machine's other core is someone else's
    steps = []

    def report(record, _path):
        steps.append((record["step"], record["loss"], record["max_logit"],
                      record["clipped_heads"], record["step_time_s"],
                      record.get("val_loss")))

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    run_training(Job.local(spec_data, plan_on_one_host(spec_data)), mesh, report)
    return steps


def run_one(preset: str, variant: str, lr: float, tau: float, steps: int,
            seed: int) -> list:
    from dmuon.testing import run

    return run(_run, spec(preset, variant, lr, tau, steps, seed), world_size=1)[0]


def summarise(name: str, variant: str, lr: float, tau: float, steps: list) -> dict:
    """One run's row: the figures are read off its steps as recorded."""
    logits = [s[2] for s in steps]
    vals = [(s[0], s[5]) for s in steps if s[5] is not None]
    over = [s[0] for s in steps if s[2] > TAU]  # against TAU, clipped or not
    clipping = tau < NO_CLIP
    # a clipped run: the steps after the first clip measure clipped weights
    after = [s[2] for s in steps if over and s[0] > over[0]] if clipping else []
    return {"name": name, "variant": variant, "lr": lr, "tau": tau if clipping else None,
            "final_val_loss": vals[-1][1], "best_val_loss": min(v for _, v in vals),
            "max_logit_start": logits[0], "max_logit_peak": max(logits),
            "max_logit_final": logits[-1], "steps_over_tau": len(over),
            "first_step_over_tau": over[0] if over else None,
            "peak_after_first_clip": max(after) if after else None,
            "clipped_heads_total": sum(s[3] for s in steps) if clipping else 0,
            "train_seconds": sum(s[4] for s in steps), "curve": steps}


def table(rows: list[dict], steps: int) -> str:
    lines = [f"| run | variant | lr | QK-clip tau | final val loss | best val loss | "
             f"max logit at step 1 | peak max logit | max logit at step {steps} | "
             f"steps with max logit > {TAU:g} | heads clipped (sum over steps) | "
             "wall time of the steps (s) |", "|---|---|---:|---:" + "|---:" * 8 + "|"]
    for r in rows:
        tau = f"{r['tau']:g}" if r["tau"] is not None else "-"
        over = f"{r['steps_over_tau']}" + (f" (first: {r['first_step_over_tau']})"
                                          if r["first_step_over_tau"] else "")
        lines.append(f"| {r['name']} | {r['variant']} | {r['lr']:g} | {tau} | "
                     f"{r['final_val_loss']:.4f} | {r['best_val_loss']:.4f} | "
                     f"{r['max_logit_start']:.2f} | {r['max_logit_peak']:.2f} | "
                     f"{r['max_logit_final']:.2f} | {over} | {r['clipped_heads_total']} | "
                     f"{r['train_seconds']:.1f} |")
    return "\n".join(lines)


def notes(rows: list[dict], args) -> str:
    """What the table says in words, computed from it (not written by hand)."""
    by = {r["name"]: r for r in rows}
    out = [f"Built-in `{args.preset}` model, {args.steps} steps of {BATCH} x {SEQ} tokens, "
           f"seed {args.seed}, fp32, one thread; tau = {TAU:g} for QK-clip "
           f"(runs without clipping track the max logits with tau = {NO_CLIP:g}); NorMuon "
           f"with its authors' beta2 = {BETA2:g} (dmuon.Muon's default) and eps = 1e-10 "
           "(arXiv 2510.05491).",
           "A step's max logit is the largest pre-softmax logit of any head in that step's "
           "forward: the weights left by the previous step's update and clip, on this "
           "step's batch. The clip brings a head's max of the step it measured to tau, "
           "then that step's update moves the weights again, so a clipped run's next "
           "steps may read over tau; they are counted as measured."]
    clip, plain = by.get("muon-high+qk-clip"), by.get("muon-high")
    if clip and plain:
        out.append(f"At lr {HIGH_LR:g}: plain Muon's max logit peaks at "
                   f"{plain['max_logit_peak']:.2f}, with QK-clip at "
                   f"{clip['max_logit_peak']:.2f} ("
                   + (f"after the first clip: {clip['peak_after_first_clip']:.2f}"
                      if clip["peak_after_first_clip"] is not None else "never clipped")
                   + f"); final val loss "
                   f"{plain['final_val_loss']:.4f} plain, {clip['final_val_loss']:.4f} "
                   "clipped.")
    for muon, nor in (("muon", "normuon"), ("muon-high", "normuon-high")):
        if muon in by and nor in by:
            out.append(f"At lr {by[muon]['lr']:g}, equal steps: final val loss Muon "
                       f"{by[muon]['final_val_loss']:.4f}, NorMuon "
                       f"{by[nor]['final_val_loss']:.4f}.")
    return "\n\n".join(out)


def main(argv=None) -> None:
    from bench._record import write_record

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(r[0] for r in RUNS),
                    help="comma-separated run names (default: all)")
    args = ap.parse_args(argv)
    wanted = args.runs.split(",")
    t0, rows = time.time(), []
    for name, variant, lr, tau in (r for r in RUNS if r[0] in wanted):
        steps = run_one(args.preset, variant, lr, tau, args.steps, args.seed)
        rows.append(summarise(name, variant, lr, tau, steps))
        print(f"{name}: val {rows[-1]['final_val_loss']:.4f}, max logit peak "
              f"{rows[-1]['max_logit_peak']:.2f}", flush=True)
    text = table(rows, args.steps)
    print(text)
    words = notes(rows, args)
    print(words)
    write_record("muon_variants", "Muon variants: QK-clip and NorMuon on the built-in "
                 "model", text, {"preset": args.preset, "steps": args.steps,
                                 "seed": args.seed, "tau": TAU, "no_clip_tau": NO_CLIP,
                                 "bench_seconds": round(time.time() - t0, 1), "runs": rows},
                 notes=words)


if __name__ == "__main__":
    main()
