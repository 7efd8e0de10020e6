"""The seeds' reference implementation's public names, on 4 gloo ranks in float64, each
against an independent reference (a single float64 process, torch.optim.Muon + AdamW, or
what every rank actually holds):

- ``dedicate_params(model, mesh, predicate)`` (positional), the plan as a mapping param ->
  owner, ``get_dedicated_params``, ``get_owned_params(model, rank=...)``;
- ``wait_all_reduces`` and ``clip_grad_norm_(optimizer, max_norm)`` against one process's
  averaged and clipped gradients, on Z3 and HSDP 2x2 (the two reduce paths);
- ``ns_backend="direct"`` and ``Muon(model, param_groups=[named groups])`` against
  torch.optim.Muon + AdamW over 10 steps;
- ``compute_dtype`` as the mixed-precision policy it names (bf16 compute, reduce in the
  params' own dtype), beside a different ``fully_shard`` policy;
- the DDP composition (``dedicate_params_ddp`` + ``replicate``) against the float64
  reference, with its bytes per step equal to the formula the docs state.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.model import build_model, get_config, muon_predicate
from helpers.train import (
    HPARAMS,
    build_dmuon,
    global_batches,
    local_rows,
    loss_of,
    lr_lambda,
    reference_optimizers,
    reference_run,
    reference_train,
)
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

STEPS, CLIP = 10, 0.05


def _train(model, opt, rank, world, steps=STEPS):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for batch in global_batches(steps):
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return dmuon.full_state_dict(model)


def _attention(name: str) -> bool:
    return "self_attn" in name or "input_layernorm" in name


def _named(model):
    """The reference's named groups: attention layers' params at one lr, the rest with
    per-kind keys."""
    named = dict(model.named_parameters())
    attn = [p for n, p in named.items() if _attention(n)]
    rest = [p for n, p in named.items() if not _attention(n)]
    return [{"params": attn, "lr": 0.01, "group_name": "attn"},
            {"params": rest, "muon_weight_decay": 0.0, "adamw_lr": 2e-3, "group_name": "rest"}]


def _named_reference():
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    named = dict(model.named_parameters())
    muon = lambda attn: [p for n, p in named.items()  # noqa: E731
                         if muon_predicate(n, p) and _attention(n) == attn]
    adamw = lambda attn: [p for n, p in named.items()  # noqa: E731
                          if not muon_predicate(n, p) and _attention(n) == attn]
    opts = reference_optimizers([{"params": muon(True), "lr": 0.01},
                                 {"params": muon(False), "weight_decay": 0.0}],
                                [{"params": adamw(True), "lr": 0.01},
                                 {"params": adamw(False), "lr": 2e-3}])
    return reference_train(model, opts, global_batches(STEPS))[0]


def _gradients(layout):
    """Owners' gradients after wait_all_reduces, then after clip_grad_norm_(optimizer)."""
    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    model, opt = build_dmuon(mesh["shard"], True, replicate_mesh=mesh["replicate"],
                             fsdp_mesh=mesh)
    rank, world = dist_rank_world()
    loss_of(model, local_rows(global_batches(1)[0], rank, world)).backward()
    dmuon.wait_all_reduces(model)
    state = dmuon.get_state(model)
    owned = {state.plan.params[u].param: t for u, t in state.owned_params.items()}
    reduced = {n: t.grad.clone() for n, t in owned.items()}
    norm = dmuon.clip_grad_norm_(opt, CLIP).item()
    return {"reduced": reduced, "clipped": {n: t.grad.clone() for n, t in owned.items()},
            "norm": norm}


def dist_rank_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _ownership(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    plan = dmuon.dedicate_params(model, mesh["shard"], muon_predicate,  # positional
                                 replicate_mesh=mesh["replicate"])
    names = {id(p): n for n, p in model.named_parameters()}
    state = dmuon.get_state(model)
    return {"plan": {names[id(p)]: owner for p, owner in plan.items()},
            "dedicated": [names[id(p)] for p in dmuon.get_dedicated_params(model)],
            "held_here": sorted({state.plan.params[u].param for u in state.owned_params}),
            "owned_of": {r: sorted(names[id(p)] for p in dmuon.get_owned_params(model, rank=r))
                         for r in range(world)},
            "owned_of_coord": {r: sorted(names[id(p)] for p in dmuon.get_owned_params(
                model, rank=(r % 2, r // 2))) for r in range(world)}}


def _refusals(model, opt):
    out = {}
    for key, call in {
        "ns_object": lambda: dmuon.Muon(model, ns_backend=object()),
        "route": lambda: dmuon.Muon(model, param_groups=[
            {"params": list(model.parameters()), "dmuon_route": "sharded_adamw"}]),
        "missing": lambda: dmuon.Muon(model, param_groups=[
            {"params": list(model.model.layers[0].parameters())}]),
        "norm_type": lambda: dmuon.clip_grad_norm_(opt, 1.0, norm_type=1.0),
    }.items():
        with pytest.raises((TypeError, ValueError)) as e:
            call()
        out[key] = str(e.value)
    return out


def _compute_dtype(rank, world, use_compute_dtype: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # FSDP2's: reduces in bf16
    # DMuon's own, as compute_dtype names it: bf16 compute, the fp32 params' reduce
    named = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_model(get_config("tiny"), dtype=torch.float32, seed=0)
    dtype = dict(compute_dtype=torch.bfloat16) if use_compute_dtype else dict(mp_policy=named)
    dmuon.dedicate_params(model, mesh, muon_predicate, **dtype)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh, mp_policy=policy)
    dmuon.fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float32)
    return _train(model, opt, rank, world, steps=3)


def _names(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    out = {"grads": {layout: _gradients(layout) for layout in ((1, 4), (2, 2))},
           "ownership": _ownership(rank, world)}
    model, opt = build_dmuon(mesh, True, ns_backend="direct")
    out["direct"] = _train(model, opt, rank, world)
    out["refusals"] = _refusals(model, opt)
    model, _ = build_dmuon(mesh, True)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64, param_groups=_named(model))
    out["group_names"] = [g["group_name"] for g in opt.param_groups]
    out["named"] = _train(model, opt, rank, world)
    out["compute_dtype"] = [_compute_dtype(rank, world, flag) for flag in (True, False)]
    return out


@functools.cache
def _runs():
    return run(_names, world_size=4)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _single_process_gradients():
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    loss_of(model, global_batches(1)[0]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item()
    return grads, {n: p.grad.clone() for n, p in model.named_parameters()}, norm


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["z3", "hsdp2x2"])
def test_wait_all_reduces_and_clip_by_optimizer_match_one_process(layout):
    grads, clipped, norm = _single_process_gradients()
    seen = set()
    for rank, res in enumerate(_runs()):
        g = res["grads"][layout]
        assert g["norm"] == pytest.approx(norm, rel=1e-12)
        for name, value in g["reduced"].items():
            assert _rel(value, grads[name]) <= 1e-12, (rank, name)
            assert _rel(g["clipped"][name], clipped[name]) <= 1e-12, (rank, name)
            seen.add(name)
    assert seen == {n for n in grads if muon_predicate(n, grads[n])}  # every matrix once


def test_plan_is_a_mapping_to_the_rank_that_holds_each_matrix():
    runs = _runs()
    holder = {name: rank for rank, res in enumerate(runs)
              for name in res["ownership"]["held_here"]}
    model = build_model(get_config("tiny"), device="meta")
    dedicated = [n for n, p in model.named_parameters() if muon_predicate(n, p)]
    for res in runs:
        own = res["ownership"]
        assert own["plan"] == holder and own["dedicated"] == dedicated
        for r in range(4):
            assert own["owned_of"][r] == sorted(n for n, h in holder.items() if h == r)
            assert own["owned_of_coord"][r] == own["owned_of"][r]


def test_direct_backend_and_named_param_groups_match_torch_muon():
    ref, _ = reference_run(STEPS)
    named_ref = _named_reference()
    for rank, res in enumerate(_runs()):
        for key, value in ref.items():
            assert _rel(res["direct"][key], value) <= 1e-9, (rank, key)
            assert _rel(res["named"][key], named_ref[key]) <= 1e-9, (rank, key)
        assert res["group_names"] == ["attn/muon", "rest/muon", "attn/adamw", "rest/adamw"]


def test_compute_dtype_is_the_mixed_precision_policy_it_names():
    for res in _runs():
        with_compute_dtype, with_policy = res["compute_dtype"]
        for key, value in with_policy.items():
            assert torch.equal(with_compute_dtype[key], value), key


def test_reference_forms_without_a_meaning_here_say_what_to_use():
    refusals = _runs()[0]["refusals"]
    assert "NewtonSchulz" in refusals["ns_object"] and "ns_coefficients" in refusals["ns_object"]
    assert "dmuon_route='sharded_adamw'" in refusals["route"]
    assert "dedicate_params(param_policy=...)" in refusals["route"]
    assert "leave out" in refusals["missing"] and "model.embed_tokens.weight" in refusals["missing"]
    assert "norm_type=1.0" in refusals["norm_type"]


# -- the DDP composition -------------------------------------------------------------------

def _ddp(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    plan = dmuon.dedicate_params_ddp(model, mesh, muon_predicate)
    dmuon.replicate(model, mesh)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    final = _train(model, opt, rank, world)
    return final, dmuon.get_ledger(model).last_step_by_phase(), plan.total_elements, \
        len(plan.params)


def test_ddp_composition_matches_the_float64_reference_and_its_byte_formula():
    ref, _ = reference_run(STEPS)
    R, elt = 4, 8
    for rank, (final, ledger, p_m, units) in enumerate(run(_ddp, world_size=R)):
        for key, value in ref.items():
            assert _rel(final[key], value) <= 1e-9, (rank, key)
        # every rank keeps every matrix: nothing moves on the shard group of one; the
        # replicate group carries the reduce-scatter to the owner and the all-gather of
        # the update, (R-1)/R x P_M x elt each, and the step's flags (4 B each: one per
        # matrix, one per rank, one for FSDP2's shards, one after NS for the updates)
        assert sum(ledger["shard"].values()) == 0, rank
        assert ledger["replicate"]["reduce"] == ledger["replicate"]["replicate"] \
            == (R - 1) * p_m * elt / R
        assert ledger["replicate"]["step"] == 2 * (R - 1) * (units + R + 2) * 4 / R
