"""Core benchmark, unthrottled: FSDP2 + AdamW, naive FSDP2 + Muon, DMuon-Z2/Z3 and DMuon
HSDP 2x2 (sync vs async replicate all-gather) in one run, at 256 and 4,096 tokens per
rank, with checkpoint save/load times (plain DCP for FSDP2 + AdamW, ``dmuon.checkpoint``
for DMuon).

4 gloo ranks on the CPU, built-in model ``small`` (d=256, 4 layers), NS in fp32. Times
are per-rank medians, then the slowest rank; the set-ups live in one set of processes
and are measured in turns (``bench._setups.take_turns``), so the machine's load falls on
all of them alike. The floor of a DMuon set-up is FSDP2 + AdamW's full step plus that
set-up's busiest rank's NS time, both from this run: the NS work has to run somewhere.
Prints tables and writes bench/results/core.json. Not a test: the targets are reported,
not asserted.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch.distributed as dist

import dmuon
from bench._setups import NS_DTYPE, SETUPS, NSClock, build, shared_cores, take_turns
from dmuon.testing import run
from service.job.models.builtin import build_model, causal_lm_loss, get_config
from service.job.models.params import split_params
from service.worker.corpus import batch_at, load_corpus

CONFIGS = ("fsdp2_adamw", "naive_fsdp2_muon", "dmuon_z2", "dmuon_z3",
           "dmuon_z3_hsdp2x2_sync", "dmuon_z3_hsdp2x2_async")
# tokens per rank -> (sequences per rank, sequence length, rounds, timed steps per round)
SIZES = {256: (4, 64, 4, 5), 4096: (16, 256, 2, 4)}
RESULTS = pathlib.Path(__file__).parent / "results"


def _checkpoint_times(config, model, opt, directory, repeats=3) -> dict:
    """Median save and load seconds: dmuon.checkpoint, or plain DCP for FSDP2 + AdamW."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = f"{directory}/{config}"
    saves, loads = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if config.startswith("dmuon"):
            dmuon.checkpoint.save(path, model, opt)
        else:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        dist.barrier()
        t1 = time.perf_counter()
        if config.startswith("dmuon"):
            dmuon.checkpoint.load(path, model, opt)
        else:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        dist.barrier()
        saves.append(t1 - t0)
        loads.append(time.perf_counter() - t1)
    return {"save_s": statistics.median(saves), "load_s": statistics.median(loads)}


def _worker(rank, world, configs, model_name, rounds, steps, batch, seq, ckpt_dir):
    clock = NSClock()
    corpus = load_corpus("train", max_bytes=1_000_000)

    def step(name, model, opt, index) -> dict:
        tokens = batch_at(corpus, index, batch * world, seq)[rank * batch:(rank + 1) * batch]
        dist.barrier()
        t0 = time.perf_counter()
        causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        return {"full": t2 - t0, "fwd_bwd": t1 - t0, "opt_step": t2 - t1, **clock.take()}

    with clock.installed():
        built = {c: build(SETUPS[c], world, model_name, clock) for c in configs}
        times = take_turns(built, rounds, steps, step)
    out = {}
    for c, (model, opt) in built.items():
        out[c] = {f"{k}_s": statistics.median(t[k] for t in times[c]) for k in times[c][0]}
        if ckpt_dir and c != "naive_fsdp2_muon":
            out[c].update(_checkpoint_times(c, model, opt, ckpt_dir))
        if c.startswith("dmuon"):
            out[c]["memory"] = dmuon.memory_report(model, opt)
    return out


def _planning_time() -> float:
    t0 = time.perf_counter()
    model = build_model(get_config("llama3-70b"), device="meta")
    dmuon.partition(model, predicate=split_params(model).predicate, shard_size=64)
    return time.perf_counter() - t0


def measure(args, tokens: int, ckpt_dir) -> dict:
    batch, seq, rounds, steps = SIZES[tokens]
    per_rank = run(_worker, CONFIGS, args.model, rounds, steps, batch, seq, ckpt_dir,
                   world_size=args.world)
    rows = {}
    for config in CONFIGS:
        rows[config] = {k: max(r[config][k] for r in per_rank)
                        for k in per_rank[0][config] if k.endswith("_s")}
        if "memory" in per_rank[0][config]:
            rows[config]["memory"] = per_rank[0][config]["memory"]
    base, naive = rows["fsdp2_adamw"], rows["naive_fsdp2_muon"]
    for config, r in rows.items():
        r["full_vs_fsdp2_adamw"] = r["full_s"] / base["full_s"]
        r["fwd_bwd_vs_fsdp2_adamw"] = r["fwd_bwd_s"] / base["fwd_bwd_s"]
        r["opt_step_vs_naive"] = r["opt_step_s"] / naive["opt_step_s"]
        if config.startswith("dmuon"):
            r["floor_s"] = base["full_s"] + r["ns_s"]
            r["full_vs_floor"] = r["full_s"] / r["floor_s"]
            r.update(_step_cpu_bound(config, per_rank, naive["opt_step_s"], args.world))
    return rows


def _step_cpu_bound(config: str, per_rank: list, naive_step_s: float, world: int) -> dict:
    """Every owner's NS runs inside the step, all ranks at once, so the step takes at
    least the NS CPU time summed over ranks, spread over the cores the ranks share."""
    cores = shared_cores(world)
    summed = sum(r[config]["ns_cpu_s"] for r in per_rank)
    return {"ns_cpu_summed_s": summed, "cores": cores, "step_cpu_bound_s": summed / cores,
            "step_cpu_bound_vs_naive": summed / cores / naive_step_s}


def _print(tokens: int, rows: dict) -> None:
    print(f"\n{tokens} tokens per rank (medians, slowest rank; NS: busiest rank)")
    print("| config | fwd+bwd (ms) | optimizer.step (ms) | NS (ms) | full step (ms) |"
          " fwd+bwd / FSDP2+AdamW | full / FSDP2+AdamW | full / floor | step / naive |"
          " ckpt save (ms) | ckpt load (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c, r in rows.items():
        floor = f"{r['full_vs_floor']:.3f}" if "full_vs_floor" in r else "-"
        ckpt = f"{r['save_s'] * 1e3:.0f} | {r['load_s'] * 1e3:.0f}" if "save_s" in r else "- | -"
        print(f"| {c} | {r['fwd_bwd_s'] * 1e3:.0f} | {r['opt_step_s'] * 1e3:.0f} |"
              f" {r['ns_s'] * 1e3:.0f} | {r['full_s'] * 1e3:.0f} |"
              f" {r['fwd_bwd_vs_fsdp2_adamw']:.3f} | {r['full_vs_fsdp2_adamw']:.3f} | {floor} |"
              f" {r['opt_step_vs_naive']:.3f} | {ckpt} |")


def _print_cpu_bound(rows: dict) -> None:
    naive = rows["naive_fsdp2_muon"]
    print(f"\noptimizer.step against the cores (naive: NS of every matrix on each rank, "
          f"{naive['ns_cpu_s'] * 1e3:.0f} ms CPU)")
    print("| config | NS CPU, summed over ranks (ms) | cores | step at least (ms) |"
          " bound / naive step | measured step / naive |\n|---|---:|---:|---:|---:|---:|")
    for c, r in rows.items():
        if "step_cpu_bound_s" in r:
            print(f"| {c} | {r['ns_cpu_summed_s'] * 1e3:.0f} | {r['cores']} |"
                  f" {r['step_cpu_bound_s'] * 1e3:.0f} | {r['step_cpu_bound_vs_naive']:.3f} |"
                  f" {r['opt_step_vs_naive']:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=sorted(SIZES), choices=sorted(SIZES))
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for tokens in args.tokens:  # checkpoint times at the first size only
            results[tokens] = measure(args, tokens, ckpt_dir if not results else None)
            _print(tokens, results[tokens])
            _print_cpu_bound(results[tokens])
    planning = _planning_time()
    print(f"\n4 ranks, model {args.model!r}, NS in {NS_DTYPE}; planning llama3-70b on meta "
          f"at N=64: {planning:.3f} s")
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "rows": results, "planning_70b_s": planning}
    (RESULTS / "core.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
