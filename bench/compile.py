"""Step time with and without torch.compile per block (inductor), 4 gloo ranks on the
CPU: DMuon-Z3 on the built-in ``small`` model, eager against ``torch.compile(block)``
registered in place of each block and ``block.compile()``, NS in fp32. The first step
(compilation) is reported apart; the step time is the median of the timed steps, of the
slowest rank. Prints a table and writes a dated record under bench/results/.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import dmuon
from bench._record import write_record
from bench._setups import NS_DTYPE
from dmuon.testing import run
from service.job.models.builtin import build_model, causal_lm_loss, get_config
from service.job.models.params import split_params

FORMS = ("eager", "torch.compile(block)", "block.compile()")


def _model(form: str, mesh):
    model = build_model(get_config("small"), seed=0)
    for i, layer in enumerate(model.model.layers):
        if form == "block.compile()":
            layer.compile()
        elif form == "torch.compile(block)":
            model.model.layers[i] = torch.compile(layer)
    dmuon.dedicate_params(model, mesh, split_params(model).predicate)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, ns_dtype=NS_DTYPE)


def _times(rank, world, batch, seq, steps):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
    out = {}
    for form in FORMS:
        torch._dynamo.reset()
        model, opt = _model(form, mesh)
        times = []
        for _ in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out[form] = {"first_s": times[0], "step_s": statistics.median(times[1:])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    ranks = run(_times, args.batch, args.seq, args.steps, world_size=4)
    rows = {f: {k: max(r[f][k] for r in ranks) for k in ("first_s", "step_s")} for f in FORMS}
    eager = rows["eager"]["step_s"]
    lines = ["| form | first step (s) | step (ms) | / eager |", "|---|---:|---:|---:|"]
    for form, r in rows.items():
        lines.append(f"| {form} | {r['first_s']:.1f} | {r['step_s'] * 1e3:.0f} | "
                     f"{r['step_s'] / eager:.3f} |")
    table = "\n".join(lines)
    print(table)
    path = write_record("compile", "torch.compile per block: step time", table,
                        {"args": vars(args), "rows": rows},
                        notes=f"DMuon-Z3, 4 gloo ranks, small model, {args.batch} x "
                              f"{args.seq} tokens per rank, NS in fp32, inductor.")
    print(f"record: {path}")


if __name__ == "__main__":
    main()
