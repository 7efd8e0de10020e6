"""The training set-ups the benchmarks compare, built the same way for each benchmark:
FSDP2 + AdamW, naive FSDP2 + Muon (every rank all-gathers each update and runs NS on
it), and DMuon in Z2, Z3 (with and without prefetch) and HSDP 2x2."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon import adjusted_lr
from dmuon.testing import probe_point
from service.job.models.builtin import build_model, get_config
from service.job.models.params import split_params

NS_DTYPE = torch.float32  # bf16 matmuls are emulated (3x to 58x slower) on these CPUs


@dataclass(frozen=True)
class Setup:
    name: str
    optimizer: str  # "adamw", "naive" or "dmuon"
    z3: bool = True
    hsdp: bool = False
    prefetch: int = 1
    replicate_async: bool = True


SETUPS = {s.name: s for s in (
    Setup("fsdp2_adamw", "adamw"),
    Setup("naive_fsdp2_muon", "naive"),
    Setup("dmuon_z2", "dmuon", z3=False),
    Setup("dmuon_z3", "dmuon"),
    Setup("dmuon_z3_no_prefetch", "dmuon", prefetch=0),
    Setup("dmuon_z3_prefetch2", "dmuon", prefetch=2),
    Setup("dmuon_z3_hsdp2x2_sync", "dmuon", hsdp=True, replicate_async=False),
    Setup("dmuon_z3_hsdp2x2_async", "dmuon", hsdp=True),
)}


class NSClock:
    """Seconds spent in Newton-Schulz on this rank (DMuon's and the naive baseline's):
    wall time, and CPU time of the calling thread (NS runs there, one intra-op thread)."""

    def __init__(self):
        self.seconds = self.cpu_seconds = 0.0

    def ns(self, G, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = _NS(G, *args, **kwargs)
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.thread_time() - c0
        return out

    @contextlib.contextmanager
    def installed(self):
        setattr(*_OPTIMIZER_NS, self.ns)
        try:
            yield self
        finally:
            setattr(*_OPTIMIZER_NS, _NS)

    def take(self) -> dict[str, float]:
        out = {"ns": self.seconds, "ns_cpu": self.cpu_seconds}
        self.seconds = self.cpu_seconds = 0.0
        return out


_OPTIMIZER_NS = probe_point("optimizer_ns")
_NS = getattr(*_OPTIMIZER_NS)


def shared_cores(world: int) -> int:
    """The cores ``world`` ranks share on this machine (here 2 for 4 ranks): CPU work
    summed over the ranks takes at least its total over this many to run."""
    return min(world, len(os.sched_getaffinity(0)))


class NaiveFSDPMuon(torch.optim.Optimizer):
    """The baseline DMuon replaces: every rank all-gathers each full Muon update and runs
    NS on it, then keeps its own rows. AdamW for the rest."""

    def __init__(self, model, clock: NSClock, lr=0.02, momentum=0.95, adamw_lr=3e-3):
        rule = split_params(model).predicate
        muon = [p for n, p in model.named_parameters() if rule(n)]
        rest = [p for n, p in model.named_parameters() if not rule(n)]
        super().__init__([dict(params=muon, lr=lr)], dict(momentum=momentum))
        self.adamw = torch.optim.AdamW(rest, lr=adamw_lr, betas=(0.9, 0.95))
        self.clock = clock

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
            ortho = self.clock.ns(full, dtype=NS_DTYPE)
            rows = p.to_local().shape[0]
            start = p.device_mesh.get_local_rank() * -(-p.shape[0] // p.device_mesh.size())
            p.to_local().add_(ortho[start:start + rows],
                              alpha=-adjusted_lr(group["lr"], None, p.shape))
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


def build(setup: Setup, world: int, model_name: str, clock: NSClock,
          fsdp_layers: bool = True):
    """The model with FSDP2 (and DMuon) applied, and its optimizer. ``fsdp_layers=False``
    wraps a DMuon set-up's FSDP2 at the root only (its layers keep just their norms)."""
    mesh = init_device_mesh("cpu", (2, world // 2) if setup.hsdp else (1, world),
                            mesh_dim_names=("replicate", "shard"))
    fsdp_mesh = mesh if setup.hsdp else mesh["shard"]
    model = build_model(get_config(model_name), seed=0)
    if setup.optimizer == "dmuon":
        dmuon.dedicate_params(model, mesh["shard"], predicate=split_params(model).predicate,
                              replicate_mesh=mesh["replicate"] if setup.hsdp else None,
                              reshard_after_forward=setup.z3, prefetch=setup.prefetch)
    for layer in model.model.layers if fsdp_layers or setup.optimizer != "dmuon" else ():
        dmuon.fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=setup.z3)
    dmuon.fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=setup.z3)
    if setup.optimizer == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    if setup.optimizer == "naive":
        return model, NaiveFSDPMuon(model, clock)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, ns_dtype=NS_DTYPE,
                             replicate_async=setup.replicate_async)


def take_turns(built: dict, rounds: int, steps: int, step) -> dict[str, list]:
    """Measure the set-ups in turns: each runs ``steps`` timed steps in a row (after one
    untimed) per round, the rounds alternating between set-ups, so that a change in the
    machine's load falls on all of them alike. Work a set-up leaves in flight (an async
    replicate all-gather) is drained before the next one's turn, so it cannot hide
    behind another set-up's steps. ``step(name, model, opt, data_index)`` returns a
    record; every set-up sees the same data indices."""
    records = {name: [] for name in built}
    for r in range(rounds):
        for name, (model, opt) in built.items():
            for s in range(steps + 1):
                record = step(name, model, opt, r * (steps + 1) + s)
                if s:
                    records[name].append(record)
            if getattr(model, "_dmuon_state", None) is not None:
                dmuon.get_state(model).drain()
    return records
