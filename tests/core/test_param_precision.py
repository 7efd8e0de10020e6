"""Per-parameter precision from ``param_policy`` (the reference guide "Pure DMuon
Routing": an fp32 action head in a bf16 body), against FSDP2's own per-module
``MixedPrecisionPolicy`` with torch.optim.AdamW, on 4 gloo ranks: every param is on an
AdamW route, so both runs do the same math and differ only in who moves what."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.model import DecoderLayer, build_model, get_config
from helpers.train import HPARAMS, global_batches, local_rows, loss_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import dmuon
from dmuon.testing import run

STEPS, WORLD = 2, 4
BF16, FP32 = torch.bfloat16, torch.float32
POLICY = {
    "defaults": {"route": "adamw", "param_dtype": BF16, "grad_dtype": FP32},
    "overrides": [
        {"name": ["embed_tokens"], "set": {"route": "sharded_adamw"}},
        {"name": ["lm_head"], "set": {"param_dtype": FP32, "grad_dtype": FP32,
                                      "output_dtype": FP32, "cast_forward_inputs": True}},
    ],
}
ADAMW = dict(lr=HPARAMS["adamw_lr"], betas=HPARAMS["adamw_betas"], eps=HPARAMS["adamw_eps"],
             weight_decay=HPARAMS["adamw_weight_decay"])


def _fsdp2_reference(model, mesh):
    """FSDP2 alone: the body in bf16 (fp32 reduce), the head in fp32 with its casts."""
    body = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)
    head = MixedPrecisionPolicy(param_dtype=FP32, reduce_dtype=FP32, output_dtype=FP32,
                                cast_forward_inputs=True)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh, mp_policy=body)
    dmuon.fully_shard(model.model.norm, mesh=mesh, mp_policy=body)
    dmuon.fully_shard(model.lm_head, mesh=mesh, mp_policy=head)
    dmuon.fully_shard(model, mesh=mesh, mp_policy=body)
    return torch.optim.AdamW(model.parameters(), **ADAMW)


def _boundaries(model):
    """One hook boundary per decoder layer, the final norm and the head."""
    ends = {id(model.model.norm), id(model.lm_head)}
    return lambda m: isinstance(m, DecoderLayer) or id(m) in ends


def _pure_dmuon(model, mesh):
    """Every param in DMuon: layers, final norm and head on owners, the embedding on
    FSDP2 (its policy from the param_policy); one hook boundary per module above."""
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: True, param_policy=POLICY,
                          hook_boundary_predicate=_boundaries(model))
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    return dmuon.Muon(model, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"],
                      adamw_eps=ADAMW["eps"], adamw_weight_decay=ADAMW["weight_decay"])


def _train(rank, world, kind):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_model(get_config("tiny"), dtype=FP32, seed=0)
    opt = (_pure_dmuon if kind == "dmuon" else _fsdp2_reference)(model, mesh)
    dtypes = {}
    for batch in global_batches(STEPS):
        if not dtypes:  # an extra forward, once: the last step's ledger is the step's own
            dtypes = {"logits": model(local_rows(batch, rank, world)[:, :-1]).dtype}
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    if kind == "dmuon":
        full = dmuon.full_state_dict(model)
        state = dmuon.get_state(model)
        dtypes.update({b.name: (b.param_dtype, b.reduce_dtype) for b in state.boundaries})
        dtypes["ledger"] = dmuon.get_ledger(model).last_step_by_phase()
        dtypes["plan"] = state.plan.to_dict()
    else:
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"full": full, "dtypes": dtypes}


@functools.cache
def _runs(kind):
    return run(_train, kind, world_size=WORLD)


def test_fp32_head_in_bf16_body_equals_fsdp2_per_module_policies():
    for rank, (mine, ref) in enumerate(zip(_runs("dmuon"), _runs("fsdp2"))):
        assert mine["dtypes"]["model.layers.0"] == (BF16, FP32)
        assert mine["dtypes"]["lm_head"] == (FP32, FP32)
        assert mine["dtypes"]["logits"] == ref["dtypes"]["logits"] == FP32
        for key, value in ref["full"].items():
            err = ((mine["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-5, (rank, key, err)
            assert not torch.equal(value, build_model(get_config("tiny"), dtype=FP32,
                                                      seed=0).state_dict()[key]), key


def test_the_planners_cost_prices_each_boundary_in_the_policys_dtypes():
    """``dmuon.planning``'s ledger prediction, given each boundary's own dtypes from the
    policy (``boundary_dtypes``: the head's fp32 among bf16 layers, every reduce fp32),
    equals the run's ledger exactly: the bf16 gathers at 2 bytes, the head's at 4."""
    from dmuon import planning
    from dmuon.partition import DedicationPlan

    meta = build_model(get_config("tiny"), device="meta")
    own = planning.boundary_dtypes(meta, predicate=lambda n, p: True, param_policy=POLICY,
                                   hook_boundary_predicate=_boundaries(meta))
    assert own["lm_head"] == (FP32, FP32) and own["model.layers.0"] == (BF16, FP32)
    sizes = {b: (p.itemsize, g.itemsize) for b, (p, g) in own.items()}
    for rank, mine in enumerate(_runs("dmuon")):
        plan = DedicationPlan.from_dict(mine["dtypes"]["plan"])
        predicted = planning.ledger_prediction(plan, rank, z3=True, param_bytes=4,
                                               reduce_bytes=4, boundary_bytes=sizes)
        assert mine["dtypes"]["ledger"] == predicted, rank
        uniform = planning.ledger_prediction(plan, rank, z3=True, param_bytes=2,
                                             reduce_bytes=4)  # what one dtype would say
        assert uniform["shard"]["forward"] < predicted["shard"]["forward"]


@pytest.mark.parametrize("policy,match", [
    ({"defaults": {"route": "adamw", "master_dtype": torch.float64}}, "master_dtype"),
    ({"defaults": {"route": "adamw", "muon_forward_unshard": "all_gather"}},
     "muon_forward_unshard"),
    ({"defaults": {"route": "adamw"}, "overrides": [
        {"name": "q_proj", "set": {"param_dtype": BF16}}]}, "one boundary has one"),
])
def test_precision_the_storage_cannot_follow_is_refused(policy, match):
    model = build_model(get_config("tiny"), device="meta")
    with pytest.raises(ValueError, match=match):
        dmuon.dedicate_params(model, None, predicate=lambda n, p: "layers" in n,
                              param_policy=policy)
