"""``zero_grad`` between a backward and the step discards that backward for every kind of
param (owned matrices and FSDP2 shards alike): the run equals, bitwise, the run that never
did that backward. Before the fix the dropped backward's reduce still landed on the owner.

Each run: 4 steps on 4 gloo ranks in float64; at steps 1 and 2 a backward on a batch
that the reference run never sees is followed by ``zero_grad`` (the optimizer's at
step 1, the model's at step 2), then the step's real backward. Both runs call the same
``zero_grad`` after every step, so ``set_to_none=False`` keeps zero gradients in both.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.train import build_dmuon, global_batches, local_rows, loss_of, optimizer_snapshot

import dmuon
from dmuon.testing import run

STEPS, DROPPED_AT = 4, (1, 2)
LAYOUTS = {"z2": ((1, 4), False), "z3": ((1, 4), True), "hsdp2x2": ((2, 2), True)}


def _train(rank, world, layout, z3, *, drop: bool, no_sync: bool, set_to_none: bool):
    from torch.distributed.device_mesh import init_device_mesh

    R, N = layout
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    model, opt = build_dmuon(mesh["shard"], z3, replicate_mesh=mesh["replicate"],
                             fsdp_mesh=mesh)
    batches, probes = global_batches(STEPS), global_batches(STEPS + 1)[1:]
    for step in range(STEPS):
        if drop and step in DROPPED_AT:
            with dmuon.no_sync(model) if no_sync else contextlib.nullcontext():
                loss_of(model, local_rows(probes[step], rank, world)).backward()
            zero = opt.zero_grad if step == DROPPED_AT[0] else model.zero_grad
            zero(set_to_none=set_to_none)
        loss_of(model, local_rows(batches[step], rank, world)).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {**dmuon.full_state_dict(model), **optimizer_snapshot(model, opt)}


def _pair(rank, world, layout, z3):
    out = {}
    for no_sync in (False, True):
        for set_to_none in (True, False):
            kw = dict(no_sync=no_sync, set_to_none=set_to_none)
            out[(no_sync, set_to_none)] = (_train(rank, world, layout, z3, drop=True, **kw),
                                           _train(rank, world, layout, z3, drop=False, **kw))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero_grad_discards_a_finished_backward(name):
    layout, z3 = LAYOUTS[name]
    for rank, runs in enumerate(run(_pair, layout, z3, world_size=4)):
        for case, (dropped, never) in runs.items():
            assert dropped.keys() == never.keys()
            for key, value in never.items():
                assert torch.equal(dropped[key], value), (name, rank, case, key)
