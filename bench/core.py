"""Core benchmark: FSDP2 + AdamW, naive FSDP2 + Muon, DMuon-Z2/Z3 and DMuon HSDP 2x2 (sync
vs async replicate broadcast) in one run, with checkpoint save/load times (plain DCP for
FSDP2 + AdamW, ``dmuon.checkpoint`` for DMuon).

4 gloo ranks on the CPU, built-in model at d=256 / 4 layers, seq 64, batch 4 per rank.
Prints a table and writes bench/results/core.json. Not a test: the targets are reported,
not asserted.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.optim import adjusted_lr
from service.local import run
from service.train.corpus import batch_at, load_corpus
from service.train.models import build_model, causal_lm_loss, get_config, muon_predicate

CONFIGS = ("fsdp2_adamw", "naive_fsdp2_muon", "dmuon_z2", "dmuon_z3",
           "dmuon_z3_hsdp2x2_sync", "dmuon_z3_hsdp2x2_async")
NS_DTYPE = torch.float32  # bf16 matmuls are ~3x slower than fp32 on this CPU
RESULTS = pathlib.Path(__file__).parent / "results"


class NaiveFSDPMuon(torch.optim.Optimizer):
    """The baseline DMuon replaces: every rank all-gathers each full Muon update and runs
    NS on it, then keeps its own rows. AdamW for the rest."""

    def __init__(self, model, lr=0.02, momentum=0.95, adamw_lr=3e-3):
        muon = [p for n, p in model.named_parameters() if muon_predicate(n, p)]
        rest = [p for n, p in model.named_parameters() if not muon_predicate(n, p)]
        super().__init__([dict(params=muon, lr=lr)], dict(momentum=momentum))
        self.adamw = torch.optim.AdamW(rest, lr=adamw_lr, betas=(0.9, 0.95))

    @torch.no_grad()
    def step(self):
        from torch.distributed.tensor import DTensor

        group = self.param_groups[0]
        for p in group["params"]:
            g = p.grad.to_local()
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(g))
            buf.lerp_(g, 1 - group["momentum"])
            local_update = g.lerp(buf, group["momentum"])
            full = DTensor.from_local(local_update, p.device_mesh, p.placements,
                                      shape=p.shape, stride=p.stride()).full_tensor()
            ortho = dmuon.newton_schulz(full, dtype=NS_DTYPE)
            rows = p.to_local().shape[0]
            start = p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size())
            p.to_local().add_(ortho[start:start + rows],
                              alpha=-adjusted_lr(group["lr"], None, p.shape))
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


def _setup(config: str, world: int, model_name: str):
    hsdp = "hsdp" in config
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (1, world),
                            mesh_dim_names=("replicate", "shard"))
    fsdp_mesh = mesh if hsdp else mesh["shard"]
    model = build_model(get_config(model_name), seed=0)
    z3 = config != "dmuon_z2"
    if config.startswith("dmuon"):
        dmuon.dedicate_params(model, mesh["shard"], predicate=muon_predicate,
                              replicate_mesh=mesh["replicate"] if hsdp else None,
                              reshard_after_forward=z3)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3)
    dmuon.fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3)
    if config == "fsdp2_adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    if config == "naive_fsdp2_muon":
        return model, NaiveFSDPMuon(model)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, ns_dtype=NS_DTYPE,
                             replicate_async=not config.endswith("sync"))


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


def _worker(rank, world, config, model_name, steps, warmup, batch, seq, ckpt_dir):
    model, opt = _setup(config, world, model_name)
    corpus = load_corpus("train", max_bytes=1_000_000)
    full, step_only = [], []
    for step in range(warmup + steps):
        tokens = batch_at(corpus, step, batch * world, seq)[rank * batch:(rank + 1) * batch]
        dist.barrier()
        t0 = time.perf_counter()
        causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        if step >= warmup:
            full.append(t2 - t0)
            step_only.append(t2 - t1)
    out = {"full_step_s": statistics.median(full), "opt_step_s": statistics.median(step_only)}
    if config != "naive_fsdp2_muon":
        out.update(_checkpoint_times(config, model, opt, ckpt_dir))
    if config.startswith("dmuon"):
        out["memory"] = dmuon.memory_report(model, opt)
        out["shard_bytes"] = float(dmuon.get_ledger(model).last_step("shard"))
    return out


def _planning_time() -> float:
    t0 = time.perf_counter()
    model = build_model(get_config("llama3-70b"), device="meta")
    dmuon.partition(model, predicate=muon_predicate, shard_size=64)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--world", type=int, default=4)
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as ckpt_dir:
        for config in CONFIGS:
            per_rank = run(_worker, config, args.model, args.steps, args.warmup, args.batch,
                           args.seq, ckpt_dir, world_size=args.world)
            rows[config] = {
                k: max(r[k] for r in per_rank)
                for k in ("full_step_s", "opt_step_s", "save_s", "load_s") if k in per_rank[0]
            }
            rows[config].update({k: per_rank[0][k] for k in ("memory", "shard_bytes")
                                 if k in per_rank[0]})
    base, naive = rows["fsdp2_adamw"], rows["naive_fsdp2_muon"]
    ratios = {
        c: {"full_step_vs_fsdp2_adamw": rows[c]["full_step_s"] / base["full_step_s"],
            "opt_step_vs_naive": rows[c]["opt_step_s"] / naive["opt_step_s"]}
        for c in CONFIGS
    }
    planning = _planning_time()
    print(f"\n{args.world} ranks, model {args.model!r}, seq {args.seq}, batch {args.batch}/rank,"
          f" NS in {NS_DTYPE}, medians of {args.steps} steps (slowest rank)")
    print("| config | full step (ms) | optimizer.step (ms) | full / FSDP2+AdamW |"
          " step / naive | ckpt save (ms) | ckpt load (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in CONFIGS:
        r, q = rows[c], ratios[c]
        ckpt = f"{r['save_s'] * 1e3:.0f} | {r['load_s'] * 1e3:.0f}" if "save_s" in r else "- | -"
        print(f"| {c} | {r['full_step_s'] * 1e3:.1f} | {r['opt_step_s'] * 1e3:.1f} | "
              f"{q['full_step_vs_fsdp2_adamw']:.2f} | {q['opt_step_vs_naive']:.2f} | {ckpt} |")
    print(f"planning llama3-70b on meta at N=64: {planning:.3f} s")
    RESULTS.mkdir(exist_ok=True)
    out = {"args": vars(args), "rows": rows, "ratios": ratios, "planning_70b_s": planning}
    (RESULTS / "core.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
