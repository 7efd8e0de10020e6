"""The DMuon core without Ray or the service: a 4-process CPU training under torchrun.

``make demo-torchrun`` runs ``torchrun -m service.dev.torchrun_demo`` on 4 processes: the
built-in model on the built-in corpus with DMuon on a 1-D shard mesh, printing the
ownership table, then per step the loss, step time and DMuon's shard-group bytes.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import leave_process_group
from service.job.models.builtin import build_model, causal_lm_loss, get_config
from service.job.models.params import split_params
from service.worker.corpus import batch_at, load_corpus


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node 4 -m service.dev.torchrun_demo", description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--mode", choices=("z2", "z3"), default="z3")
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    z3 = args.mode == "z3"

    model = build_model(get_config(args.model), seed=0)
    plan = dmuon.dedicate_params(model, mesh, predicate=split_params(model).predicate,
                                 reshard_after_forward=z3)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    dmuon.fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)
    corpus = load_corpus("train")
    if rank == 0:
        print(f"DMuon-{args.mode.upper()} on {world} gloo ranks, model {args.model!r}")
        print(plan.table(), flush=True)

    for step in range(args.steps):
        start = time.perf_counter()
        batch = batch_at(corpus, step, args.batch_size * world, args.seq_len)
        tokens = batch[rank * args.batch_size:(rank + 1) * args.batch_size]
        loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        elapsed = time.perf_counter() - start
        if rank == 0:
            shard_bytes = dmuon.get_ledger(model).last_step("shard")
            print(f"step {step:3d}  loss {mean.item() / world:.4f}  step {elapsed * 1e3:7.1f} ms"
                  f"  shard bytes {int(shard_bytes):,}", flush=True)
    leave_process_group()


if __name__ == "__main__":
    main()
