"""The seeds' set-up, as their Core Concepts page and FAQ write it: ``import dmuon``, then
``dmuon.dedicate_params``, then plain ``torch.distributed.fsdp.fully_shard`` per layer and
on the root (Z3, Z2, HSDP 2x2 with ``replicate_async=True``, and TP first, then DMuon,
then FSDP2). Each trains 10 steps in float64 on 4 gloo ranks and must end ``torch.equal``
to the same run written with ``dmuon.fully_shard``.

A ``fully_shard`` bound before ``import dmuon`` is FSDP2's own (the forked ranks import
dmuon at start-up, so the test takes the function the public name had before: the one
``torch.distributed.fsdp._fully_shard`` defines). Called on a dedicated model it must
not fail with a storage-size error: ``dmuon.Muon`` (or ``materialize``, for a meta model)
names the param and the fix, and DMuon's storage is untouched.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.model import build_model, get_config, muon_predicate
from helpers.train import HPARAMS, global_batches, local_rows, loss_of
from test_tp import _tp_plan

import dmuon
from dmuon.testing import run

STEPS = 10


def _seed_setup(rank, world, scenario: str, use_dmuon_wrapper: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as plain_fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    fully_shard = dmuon.fully_shard if use_dmuon_wrapper else plain_fully_shard
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    z3, replicate_mesh, muon_kwargs = scenario != "z2", None, {}
    if scenario == "hsdp":
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        mesh, fsdp_mesh, replicate_mesh = hsdp["shard"], hsdp, hsdp["replicate"]
        muon_kwargs["replicate_async"] = True
    elif scenario == "tp":
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for layer in model.model.layers:
            parallelize_module(layer, mesh2d["tp"], _tp_plan())  # TP first
        mesh = fsdp_mesh = mesh2d["dp"]
    else:
        mesh = fsdp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    dmuon.dedicate_params(model, mesh, predicate=muon_predicate, replicate_mesh=replicate_mesh,
                          reshard_after_forward=z3)
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64, **muon_kwargs)
    dp_rank, dp = (mesh.get_local_rank(), 2) if scenario == "tp" else (rank, world)
    for batch in global_batches(STEPS):
        loss_of(model, local_rows(batch, dp_rank, dp)).backward()
        opt.step()
        opt.zero_grad()
    fsdp2_managed = {n for n, p in model.named_parameters()
                     if type(p).__name__ == "DTensor" and p.device_mesh == fsdp_mesh}
    return dmuon.full_state_dict(model), fsdp2_managed


def _both_ways(rank, world):
    return {(scenario, wrapper): _seed_setup(rank, world, scenario, wrapper)
            for scenario in ("z3", "z2", "hsdp", "tp") for wrapper in (False, True)}


@functools.cache
def _runs():
    return run(_both_ways, world_size=4)


@pytest.mark.parametrize("scenario", ["z3", "z2", "hsdp", "tp"])
def test_seed_snippet_with_plain_fully_shard_equals_dmuon_fully_shard(scenario):
    model = build_model(get_config("tiny"), device="meta")
    not_dedicated = {n for n, p in model.named_parameters() if not muon_predicate(n, p)}
    for rank, runs in enumerate(_runs()):
        (plain, plain_managed), (wrapped, wrapped_managed) = \
            runs[(scenario, False)], runs[(scenario, True)]
        # FSDP2 manages exactly the params DMuon does not own, both ways
        assert plain_managed == wrapped_managed == not_dedicated, rank
        assert plain.keys() == wrapped.keys()
        for key, value in wrapped.items():
            assert torch.equal(plain[key], value), (scenario, rank, key)


def _prebound(rank, world, on_meta: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import _fully_shard
    from torch.distributed.fsdp import fully_shard as public

    fsdp2_own = _fully_shard.fully_shard  # what `from torch.distributed.fsdp import
    assert public.__wrapped__ is fsdp2_own  # fully_shard` gave before `import dmuon`
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0,
                        device="meta" if on_meta else "cpu")
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if not on_meta}
    dmuon.dedicate_params(model, mesh, predicate=muon_predicate)
    state = dmuon.get_state(model)
    before = {fqn: p.detach().clone() for fqn, p in state.owned_params.items()}
    packed = [(b.packed.data_ptr(), b.live_bytes()) for b in state.boundaries]
    for layer in model.model.layers:
        fsdp2_own(layer, mesh=mesh)  # no storage-size error inside the call
    fsdp2_own(model, mesh=mesh)
    with pytest.raises(RuntimeError) as e:
        if on_meta:
            dmuon.materialize(model, seed=0)
        else:
            dmuon.Muon(model, lr=0.02)
    # bitwise (a meta model's masters hold whatever torch.empty gave them)
    return {"message": str(e.value), "owned_unchanged": all(
                torch.equal(p.view(torch.int64), before[fqn].view(torch.int64))
                for fqn, p in state.owned_params.items()),
            "owned_equal_initial": all(torch.equal(p, initial[state.plan.params[fqn].param])
                                       for fqn, p in state.owned_params.items())
            if not on_meta else True,
            "packed_unchanged": packed == [(b.packed.data_ptr(), b.live_bytes())
                                           for b in state.boundaries],
            "owned": len(before)}


@pytest.mark.parametrize("on_meta", [False, True], ids=["values", "meta"])
def test_fully_shard_bound_before_import_names_the_param_and_the_fix(on_meta):
    results = run(_prebound, on_meta, world_size=4)
    for rank, res in enumerate(results):
        message = res["message"]
        assert "'model.layers.0." in message and "dedicated to DMuon" in message, message
        assert "imported before `import dmuon`" in message and "dmuon.fully_shard" in message
        assert "storage" not in message
        assert res["owned_unchanged"] and res["owned_equal_initial"], rank
        assert res["packed_unchanged"], rank
    assert sum(r["owned"] for r in results) == len(
        dmuon.partition(build_model(get_config("tiny"), device="meta"),
                        predicate=muon_predicate, shard_size=4).params)
