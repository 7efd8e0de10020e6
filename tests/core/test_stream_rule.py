"""The stream rule's CPU shadow: whatever DMuon enqueues under ``Streams.issuing`` is
waited for by its consumer, whether or not a collective went out, and no packed buffer is
freed before that wait.

On CUDA a group of one rank sends nothing, but the copy of this rank's segment into the
packed buffer (and a one-rank reduce-scatter's copy out) still runs on the side stream;
gloo has no streams, so the tests swap in a ``Streams`` double whose side-stream handles
record when they are waited for, and check each consumer: a block's forward reads its
packed buffer, ``free`` releases it, the step lands the reduced gradient. The layouts are
the ones whose shard group has one rank: the DDP composition (R x 1, Z2) and HSDP with
N = 1 (Z3).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from helpers.model import build_model, get_config, muon_predicate
from helpers.train import HPARAMS, global_batches, local_rows, loss_of
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon import comm
from dmuon.boundary_grads import BoundaryGradients
from dmuon.boundary_transfer import BoundaryTransfer
from dmuon.buffers import Boundary
from dmuon.reduce import GradientReduce
from dmuon.testing import run


class _Handle(comm.Issued):
    """A side-stream handle that remembers whether its consumer waited for it."""

    def __init__(self, kind: str, boundary: str | None):
        super().__init__()
        self.kind, self.boundary, self.waited = kind, boundary, False

    def wait(self) -> None:
        self.waited = True
        super().wait()


class RecordingStreams(comm.Streams):
    """``Streams`` on the CPU that hands out recording handles, each tagged with the
    boundary whose gather, replicate or reduce issued it."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.handles: list[_Handle] = []
        self.current: str | None = None

    @contextlib.contextmanager
    def issuing(self, kind: str):
        handle = _Handle(kind, self.current)
        self.handles.append(handle)
        yield handle

    def unwaited(self, boundary: str, kinds=("gather", "reduce")) -> list[str]:
        return [h.kind for h in self.handles
                if h.boundary == boundary and h.kind in kinds and not h.waited]


@contextlib.contextmanager
def _tagged(streams: RecordingStreams):
    """Tag every handle with the boundary being served: gathers and replicates by
    ``BoundaryTransfer``'s methods, reduces by ``GradientReduce._issue``."""
    saved = {(BoundaryTransfer, "start_gather"): BoundaryTransfer.start_gather,
             (BoundaryTransfer, "start_replicate"): BoundaryTransfer.start_replicate,
             (GradientReduce, "_issue"): GradientReduce._issue}

    def serving(fn, which):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            b = which(self, args)
            outer, streams.current = streams.current, b.name
            try:
                return fn(self, *args, **kwargs)
            finally:
                streams.current = outer
        return wrapper

    BoundaryTransfer.start_gather = serving(BoundaryTransfer.start_gather,
                                            lambda s, a: s.boundary)
    BoundaryTransfer.start_replicate = serving(BoundaryTransfer.start_replicate,
                                               lambda s, a: s.boundary)
    GradientReduce._issue = serving(GradientReduce._issue, lambda s, a: a[0])
    try:
        yield
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)


@contextlib.contextmanager
def _consumers(streams: RecordingStreams, model, violations: list):
    """Check at each consumer that the handles it depends on were waited for."""
    free, land = Boundary.free, BoundaryGradients.land

    def checked_free(self):
        violations.extend(("free", self.name, k) for k in streams.unwaited(self.name,
                                                                           ("gather",)))
        return free(self)

    def checked_land(self, owned_flat, divisor):
        name = self.boundary.name
        violations.extend(("land", name, k) for k in streams.unwaited(name, ("reduce",)))
        return land(self, owned_flat, divisor)

    def before_compute(module, args):  # runs after DMuon's pre-hook: the block computes next
        name = module._dmuon_boundary.name
        violations.extend(("forward", name, k) for k in streams.unwaited(name, ("gather",)))

    for layer in model.model.layers:
        layer.register_forward_pre_hook(before_compute)
    Boundary.free, BoundaryGradients.land = checked_free, checked_land
    try:
        yield
    finally:
        Boundary.free, BoundaryGradients.land = free, land


def _train(rank, world, composition):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    if composition == "ddp":
        dmuon.dedicate_params_ddp(model, mesh, muon_predicate)
        dmuon.replicate(model, mesh)
    else:  # HSDP with a shard group of one: world x 1, Z3
        hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        dmuon.dedicate_params(model, hsdp["shard"], muon_predicate,
                              replicate_mesh=hsdp["replicate"])
        for layer in model.model.layers:
            dmuon.fully_shard(layer, mesh=hsdp)
        dmuon.fully_shard(model, mesh=hsdp)
    streams = RecordingStreams()
    dmuon.get_state(model).ctx.streams = streams
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    violations: list = []
    with _tagged(streams), _consumers(streams, model, violations):
        for batch in global_batches(2):
            loss_of(model, local_rows(batch, rank, world)).backward()
            opt.step()
            opt.zero_grad()
    kinds = sorted({h.kind for h in streams.handles})
    return violations, kinds, dmuon.get_ledger(model).last_step("shard")


@pytest.mark.parametrize("composition", ["ddp", "hsdp_n1"])
def test_a_one_rank_shard_groups_side_stream_work_is_waited_for(composition):
    for rank, (violations, kinds, shard_bytes) in enumerate(
            run(_train, composition, world_size=2)):
        assert shard_bytes == 0, rank  # the shard group has one rank: nothing is sent
        assert kinds == ["gather", "reduce"], rank  # the double saw both side streams
        assert violations == [], (rank, violations[:4])
