"""``process_group_policy="isolated"`` and the reference's explicit post-backward and
post-step calls (``prepare_muon_grads``, ``broadcast_all_updates(_async)``,
``install_patch``), on HSDP 2 x 2 with the pure-DMuon policy and asynchronous publish."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from helpers.model import build_model, get_config
from helpers.routing import PURE_POLICY, pure_boundaries
from helpers.train import HPARAMS, global_batches, local_rows, loss_of
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

STEPS, WORLD, N = 4, 4, 2


def _build():
    mesh = init_device_mesh("cpu", (2, N), mesh_dim_names=("replicate", "shard"))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    dmuon.dedicate_params(model, mesh["shard"], predicate=lambda n, p: p.requires_grad,
                          replicate_mesh=mesh["replicate"], hook_boundary_predicate=pure_boundaries(
                              model), param_policy=PURE_POLICY, process_group_policy="isolated")
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64, replicate_async=True)


def _trainer_collectives(rank):
    """What a training loop does on the world group: a metric all-reduce, a broadcast
    and an all-reduce left in flight."""
    t = torch.full((1000,), float(rank), dtype=torch.float64)
    dist.all_reduce(t)
    dist.broadcast(t, src=3)
    return dist.all_reduce(torch.ones(77, dtype=torch.float64), async_op=True)


def _train(rank, world, variant):
    model, opt = _build()
    losses = []
    for batch in global_batches(STEPS):
        loss = loss_of(model, local_rows(batch, rank, world))
        loss.backward()
        if variant == "noisy":  # between backward and the step
            _trainer_collectives(rank).wait()
        if variant == "explicit":
            dmuon.prepare_muon_grads(model)
        opt.step()
        if variant == "noisy":  # while the step's replicate all-gathers are in flight
            work = _trainer_collectives(rank)
        if variant == "explicit":
            dmuon.broadcast_all_updates_async(model)
            dmuon.broadcast_all_updates(model)
        opt.zero_grad()
        if variant == "noisy":
            work.wait()
        losses.append(loss.item())
    return {"losses": losses, "full": dmuon.full_state_dict(model)}


def _columns(state) -> dict:
    return {b.name: b.column_values.clone() for b in state.boundaries}


def _edited(rank, world):
    """Owners change their masters outside the step; replicas see it only once the
    updates are broadcast."""
    model, opt = _build()
    loss_of(model, local_rows(global_batches(1)[0], rank, world)).backward()
    opt.step()
    dmuon.wait_all_post_step_broadcasts(model)
    state = dmuon.get_state(model)
    before = _columns(state)
    with torch.no_grad():
        for master in state.owned_params.values():
            master.mul_(2)
        for b in state.boundaries:
            b.publish()  # the masters into this rank's own segment (a no-op in fp64)
    stale = _columns(state)
    dmuon.broadcast_all_updates(model)
    return {"before": before, "stale": stale, "after": _columns(state)}


@functools.cache
def _runs(variant):
    return run(_train, variant, world_size=WORLD)


@pytest.mark.parametrize("variant", ["noisy", "explicit"])
def test_trainer_collectives_and_explicit_calls_change_nothing(variant):
    for plain, other in zip(_runs("plain"), _runs(variant)):
        assert plain["losses"] == other["losses"]
        for key, value in plain["full"].items():
            assert torch.equal(value, other["full"][key]), (variant, key)


def test_broadcast_all_updates_reaches_every_replica():
    res = run(_edited, world_size=WORLD)
    for s in range(N):
        a, b = res[s], res[s + N]  # the two replicas of shard column s
        for name, before in a["before"].items():
            assert torch.equal(a["after"][name], b["after"][name]), (s, name)
            assert torch.equal(a["after"][name], 2 * before), (s, name)
        # before the broadcast each replica had doubled only the segments it owns
        assert any(not torch.equal(a["stale"][n], b["stale"][n]) for n in a["stale"])


def test_refusals_and_the_patch():
    model = build_model(get_config("tiny"), device="meta")
    with pytest.raises(ValueError, match="'shared'"):
        dmuon.dedicate_params(model, None, predicate=lambda n, p: True,
                              process_group_policy="shared")
    dmuon.install_patch()
    dmuon.install_patch()  # idempotent
    from torch.distributed import fsdp

    assert fsdp.fully_shard is dmuon.fully_shard
    assert dmuon.utils.prepare_muon_grads is dmuon.prepare_muon_grads
