"""``dedicate_params(plan=...)``: a stored plan (``DedicationPlan.to_dict()``, as a planner
stores it) is applied as it is, and one that no longer describes the model or the mesh is
refused, naming the first unit that differs, before any collective."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.train import (
    HPARAMS,
    build_model,
    get_config,
    global_batches,
    local_rows,
    loss_of,
    lr_lambda,
    muon_predicate,
    reference_run,
)

import dmuon
from dmuon.partition import check_plan, model_entries
from dmuon.testing import run

STEPS, WORLD, LAYOUT = 3, 4, (2, 2)
COLLECTIVES = ("all_gather_object", "new_group", "broadcast", "all_reduce", "reduce",
               "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier")


def _meta_model():
    return build_model(get_config("tiny"), dtype=torch.float64, device="meta")


def _stored(shard=2, replicate=2) -> dict:
    """The partitioner's plan, through JSON as a store keeps it."""
    plan = dmuon.partition(_meta_model(), predicate=muon_predicate, shard_size=shard,
                           replicate_size=replicate)
    return json.loads(json.dumps(plan.to_dict()))


def _rotated(stored: dict) -> dict:
    """A valid plan the partitioner would not make: every owner moved one rank on."""
    out = copy.deepcopy(stored)
    world = out["shard_size"] * out["replicate_size"]
    for a in out["params"].values():
        a["owner"] = (a["owner"] + 1) % world
        a["owner_coord"] = list(divmod(a["owner"], out["shard_size"]))
    return out


def test_a_stored_plan_reads_back_equal():
    stored = _stored()
    plan = dmuon.DedicationPlan.from_dict(stored)
    assert plan.to_dict() == stored
    assert plan == dmuon.partition(_meta_model(), predicate=muon_predicate, shard_size=2,
                                   replicate_size=2)


def _renamed(stored, old, new):
    out = copy.deepcopy(stored)
    out["params"] = {(new if u == old else u): {**a, "param": new if u == old else a["param"]}
                     for u, a in out["params"].items()}
    return out


def _edited(stored, unit, **fields):
    out = copy.deepcopy(stored)
    out["params"][unit].update(fields)
    return out


Q0, K0 = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


def _cases(stored):
    q = stored["params"][Q0]
    dropped = copy.deepcopy(stored)
    del dropped["params"][K0]
    swapped = copy.deepcopy(stored)
    items = list(swapped["params"].items())
    items[0], items[1] = items[1], items[0]
    swapped["params"] = dict(items)
    return [
        (_renamed(stored, Q0, "model.layers.0.attn.q.weight"),
         "'model.layers.0.attn.q.weight' is in the plan but is no Muon-target param of this "
         f"model (the model has '{Q0}' there)"),
        (_edited(stored, Q0, shape=[q["shape"][0], q["shape"][1] + 1]),
         f"'{Q0}': the plan's shape is {(q['shape'][0], q['shape'][1] + 1)!r}, this model's "
         f"{tuple(q['shape'])!r}"),
        (_edited(stored, Q0, boundary="model.layers.1"),
         f"'{Q0}': the plan's hook boundary is 'model.layers.1', this model's 'model.layers.0'"),
        (dropped, f"'{K0}' is a Muon-target param of this model the plan does not list"),
        (swapped, f"'{Q0}' comes at another position in the plan"),
        (_edited(stored, Q0, owner=4, owner_coord=[2, 0]),
         f"'{Q0}': owner 4 at (2, 0) is not a rank of a 2 x 2 mesh"),
    ]


def test_a_plan_that_differs_from_the_model_is_refused_naming_the_first_unit():
    stored, entries = _stored(), model_entries(_meta_model(), muon_predicate)
    for edited, message in _cases(stored):
        with pytest.raises(dmuon.PlanMismatch) as refused:
            check_plan(dmuon.DedicationPlan.from_dict(edited), entries, 2, 2)
        assert message in str(refused.value)
    with pytest.raises(dmuon.PlanMismatch, match=r"the plan is for a 2 x 2 \(replicate x "
                                                 r"shard\) mesh; this one is 1 x 4"):
        check_plan(dmuon.DedicationPlan.from_dict(stored), entries, 4, 1)


def _counting_collectives():
    calls, saved = [], {name: getattr(torch.distributed, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            calls.append(name)
            return saved[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(torch.distributed, name, counted(name))
    return calls, lambda: [setattr(torch.distributed, n, f) for n, f in saved.items()]


def _refused(mesh, edited) -> tuple[str, list]:
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    calls, restore = _counting_collectives()
    try:
        dmuon.dedicate_params(model, mesh["shard"], muon_predicate,
                              replicate_mesh=mesh["replicate"], plan=edited)
    except dmuon.PlanMismatch as e:
        return str(e), calls
    finally:
        restore()
    return "", calls


def _apply_and_train(rank, world, stored, edited):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", LAYOUT, mesh_dim_names=("replicate", "shard"))
    refusal = _refused(mesh, edited)
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    dmuon.dedicate_params(model, mesh["shard"], muon_predicate,
                          replicate_mesh=mesh["replicate"], plan=stored)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **{**HPARAMS, "ns_dtype": torch.float64})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for batch in global_batches(STEPS):
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    held = sorted(dmuon.get_state(model).owned_params)
    return {"refusal": refusal, "plan": dmuon.get_plan(model).to_dict(), "held": held,
            "final": dmuon.full_state_dict(model)}


def test_dedicate_params_runs_the_stored_plan_and_refuses_an_edited_one():
    """Owners rotated by one rank: each rank keeps exactly the masters the stored plan
    gives it, and training matches the float64 single-process reference (1e-9, the HSDP
    tests' bound); the plan without its first unit is refused on every rank with no
    collective issued."""
    stored = _rotated(_stored())
    edited = _renamed(stored, Q0, "model.layers.0.attn.q.weight")
    want, _ = reference_run(STEPS)
    for rank, res in enumerate(run(_apply_and_train, stored, edited, world_size=WORLD)):
        message, calls = res["refusal"]
        assert "'model.layers.0.attn.q.weight' is in the plan" in message, (rank, message)
        assert calls == [], (rank, calls)
        assert {u: a["owner"] for u, a in res["plan"]["params"].items()} == \
            {u: a["owner"] for u, a in stored["params"].items()}
        assert res["held"] == sorted(u for u, a in stored["params"].items()
                                     if a["owner"] == rank)
        for key, value in want.items():
            got = res["final"][key]
            assert ((got - value).abs().max() / value.abs().max()).item() <= 1e-9, (rank, key)
