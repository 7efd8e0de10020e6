"""Overlap, shown by the order of events on each rank: a trace of (event, boundary) with
DMuon's collectives recorded as its comm layer issues them and the blocks' compute
marked by hooks the test adds after DMuon's.

- forward: boundary k+1's all-gather is issued before boundary k's compute ends;
- Z3 backward: the last boundary's re-gather is issued before the backward begins, and
  boundary k-1's before boundary k's backward ends;
- HSDP: replicate-stage reduce-scatters are issued during the backward, and the next
  forward waits for each async replicate all-gather where it issues that boundary's
  gather (on CUDA: on the gather stream, not the compute stream);
- FSDP2's unshard of a block in its pre-backward goes before DMuon's traffic issued there.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from helpers.collectives import DMuonCollectives
from helpers.model import ModelConfig, build_model, muon_predicate
from helpers.train import HPARAMS, global_batches, local_rows, loss_of
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

LAYERS = 4
CONFIG = ModelConfig(vocab_size=256, dim=64, n_layers=LAYERS, n_heads=4, n_kv_heads=2,
                     ffn_dim=128, max_seq_len=64)


def _mark(events, model):
    for k, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, a, o, k=k: events.append(("forward_done", k)))

        def on_input(m, args, k=k):
            args[0].register_hook(lambda g: events.append(("backward_done", k)))
        layer.register_forward_pre_hook(on_input)


@contextlib.contextmanager
def _fsdp2_pre_backwards(events):
    """Marks each FSDP2 group's pre-backward (its unshard for the backward) as it begins."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.pre_backward

    def pre_backward(group, *args):
        events.append(("fsdp2_pre_backward", group._module_fqn))
        return original(group, *args)

    FSDPParamGroup.pre_backward = pre_backward
    try:
        yield
    finally:
        FSDPParamGroup.pre_backward = original


@contextlib.contextmanager
def _replicate_waits(events):
    """Marks each wait for a pending replicate all-gather with the issuing context it is
    made in: ``"gather"`` inside ``Streams.issuing("gather")`` (on CUDA the gather stream
    waits), None outside it (on CUDA the compute stream would wait)."""
    from dmuon import comm
    from dmuon.boundary_transfer import BoundaryTransfer

    issuing, wait = comm.Streams.issuing, BoundaryTransfer.wait_replicate
    where = [None]

    @contextlib.contextmanager
    def tracked_issuing(streams, kind):
        outer, where[0] = where[0], kind
        try:
            with issuing(streams, kind) as issued:
                yield issued
        finally:
            where[0] = outer

    def tracked_wait(transfer):
        if transfer.replicate is not None:
            events.append(("wait_replicate", transfer.boundary.name, where[0]))
        return wait(transfer)

    comm.Streams.issuing, BoundaryTransfer.wait_replicate = tracked_issuing, tracked_wait
    try:
        yield
    finally:
        comm.Streams.issuing, BoundaryTransfer.wait_replicate = issuing, wait


def _train(rank, world, layout):
    R, N = layout
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    model = build_model(CONFIG, dtype=torch.float64, seed=0)
    dmuon.dedicate_params(model, mesh["shard"], predicate=muon_predicate, prefetch=1,
                          replicate_mesh=mesh["replicate"] if R > 1 else None)
    fsdp_mesh = mesh if R > 1 else mesh["shard"]
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=fsdp_mesh)
    dmuon.fully_shard(model, mesh=fsdp_mesh)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    events = []
    _mark(events, model)
    with DMuonCollectives(events), _fsdp2_pre_backwards(events), _replicate_waits(events):
        for step, batch in enumerate(global_batches(2)):
            events.append(("step_begins", step))
            loss = loss_of(model, local_rows(batch, rank, world))
            events.append(("backward_begins", step))
            loss.backward()
            events.append(("backward_returned", step))
            opt.step()
            opt.zero_grad()
    return events


@functools.cache
def events(layout):
    return run(_train, layout, world_size=4)


def _last_step(trace):
    return trace[max(i for i, e in enumerate(trace) if e == ("step_begins", 1)):]


def _gathers(trace, phase, begin, end):
    """Indices of the shard all-gathers of ``phase`` between two markers."""
    lo, hi = trace.index(begin), trace.index(end)
    return [i for i in range(lo, hi) if trace[i] == ("all_gather_v", "shard", phase)]


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["1x4", "hsdp2x2"])
def test_next_boundary_gather_is_issued_before_this_boundary_ends(layout):
    for rank, full in enumerate(events(layout)):
        trace = _last_step(full)
        forward = _gathers(trace, "forward", ("step_begins", 1), ("backward_begins", 1))
        assert len(forward) == LAYERS  # one gather per boundary
        for k in range(LAYERS - 1):
            assert forward[k + 1] < trace.index(("forward_done", k)), (rank, k)


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["1x4", "hsdp2x2"])
def test_z3_backward_regathers_in_reverse_ahead_of_need(layout):
    for rank, full in enumerate(events(layout)):
        trace = _last_step(full)
        # the last block's re-gather goes out when the forward returns (under the loss
        # and the head's backward), then one per block in reverse
        backward = _gathers(trace, "backward", ("step_begins", 1), ("backward_returned", 1))
        assert len(backward) == LAYERS
        assert backward[0] < trace.index(("backward_begins", 1))
        # issued for layers L-1, L-2, ..., 0: the one for k-1 before k's backward ends
        for j, k in enumerate(range(LAYERS - 1, 0, -1)):
            assert backward[j + 1] < trace.index(("backward_done", k)), (rank, k)


def test_hsdp_replicate_reduce_is_issued_during_backward():
    for rank, full in enumerate(events((2, 2))):
        trace = _last_step(full)
        lo, hi = trace.index(("backward_begins", 1)), trace.index(("backward_returned", 1))
        during = [e for e in trace[lo:hi] if e == ("reduce_scatter_v", "replicate", "reduce")]
        assert len(during) >= LAYERS - 1, (rank, len(during))


def test_hsdp_forward_waits_for_replicates_where_gathers_are_issued():
    """The async replicate all-gathers of step 0 write the column values that step 1's
    forward gathers read. Each is waited for inside the gather's issuing context, just
    before that gather: on CUDA the gather stream waits and the compute stream runs
    boundary k while k+1's replicate is still on the wire. Waited for on the compute
    stream, the prefetch issued in k's pre-forward would hold k's compute until then."""
    for rank, full in enumerate(events((2, 2))):
        trace = _last_step(full)
        end = trace.index(("backward_begins", 1))
        waits = [i for i in range(end) if trace[i][0] == "wait_replicate"]
        assert len(waits) == LAYERS, (rank, [trace[i] for i in waits])
        for i in waits:
            assert trace[i][2] == "gather", (rank, trace[i])
            issued = next(e for e in trace[i + 1:] if e[0] in DMuonCollectives.NAMES)
            assert issued == ("all_gather_v", "shard", "forward"), (rank, trace[i], issued)


def test_fsdp2_unshards_a_block_before_dmuon_sends_around_it():
    """In block k's pre-backward, FSDP2's unshard of k's own params (here the norms) goes
    out before DMuon's re-gather of block k-1 and reduce of block k+1: on the CPU FSDP2's
    collectives block, and queued behind that bulk they would hold up a backward whose
    parameters have already arrived."""
    for rank, full in enumerate(events((1, 4))):
        trace = _last_step(full)
        lo, hi = trace.index(("backward_begins", 1)), trace.index(("backward_returned", 1))
        regathers = _gathers(trace, "backward", ("step_begins", 1), ("backward_returned", 1))
        reduces = [i for i in range(lo, hi) if trace[i] == ("reduce_scatter_v", "shard", "reduce")]
        for j, k in enumerate(range(LAYERS - 1, 0, -1)):  # k-1's re-gather, issued in k's
            unshard = trace.index(("fsdp2_pre_backward", f"model.layers.{k}"))
            assert unshard < regathers[j + 1], (rank, k)
        for j, k in enumerate(range(LAYERS - 2, -1, -1)):  # k+1's reduce, issued in k's
            unshard = trace.index(("fsdp2_pre_backward", f"model.layers.{k}"))
            assert unshard < reduces[j], (rank, k)
