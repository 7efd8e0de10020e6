"""torch-style param groups in ``dmuon.Muon``: attention matrices without weight decay,
MLP matrices at half the learning rate, AdamW for the rest, one LR schedule over all,
against torch.optim.Muon with the same groups; and a checkpoint taken with groups
resumes bit-identically."""

from __future__ import annotations

import functools
import os

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
    reference_train,
)
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

STEPS, SAVE_AT, WORLD = 10, 5, 4
H = HPARAMS


def _groups(model):
    named = dict(model.named_parameters())
    attn = [p for n, p in named.items() if muon_predicate(n, p) and "self_attn" in n]
    mlp = [p for n, p in named.items() if muon_predicate(n, p) and ".mlp." in n]
    rest = [p for n, p in named.items() if not muon_predicate(n, p)]
    return [{"params": attn, "weight_decay": 0.0},
            {"params": mlp, "lr": H["lr"] / 2},
            {"params": rest}]


def _trainer(model, opt, sched, rank, world, start, stop, save=None):
    for batch in global_batches(STEPS)[start:stop]:
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    if save:
        dmuon.checkpoint.save(save, model, opt, extra={"sched": sched.state_dict()})


def _build(world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model, _ = build_dmuon(mesh, True)
    opt = dmuon.Muon(_groups(model), **H, ns_dtype=torch.float64)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def _train(rank, world, path):
    model, opt, sched = _build(world)
    attn, _, rest = (g["params"] for g in _groups(model))
    with pytest.raises(ValueError) as mixed:
        dmuon.Muon([{"params": [attn[0], rest[0]]}])
    _trainer(model, opt, sched, rank, world, 0, SAVE_AT, save=path)
    _trainer(model, opt, sched, rank, world, SAVE_AT, STEPS)
    out = {"full": dmuon.full_state_dict(model), "mixed": str(mixed.value), "groups": [
        {k: v for k, v in g.items() if k in ("kind", "lr", "weight_decay")}
        for g in opt.param_groups]}
    model, opt, sched = _build(world)  # fresh processes' view: load, run the rest
    sched.load_state_dict(dmuon.checkpoint.load(path, model, opt)["sched"])
    _trainer(model, opt, sched, rank, world, SAVE_AT, STEPS)
    out["resumed"] = dmuon.full_state_dict(model)
    return out


@functools.cache
def dist_run(path):
    return run(_train, path, world_size=WORLD)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return dist_run(os.path.join(str(tmp_path_factory.mktemp("groups")), "ckpt"))


def reference():
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    attn, mlp, rest = (g["params"] for g in _groups(model))
    opts = reference_optimizers([{"params": attn, "weight_decay": 0.0},
                                 {"params": mlp, "lr": H["lr"] / 2}], rest)
    return reference_train(model, opts, global_batches(STEPS))[0]


def test_groups_match_torch_muon_with_the_same_groups(results):
    ref = reference()
    for rank, res in enumerate(results):
        for key, value in ref.items():
            err = ((res["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (rank, key, err)
        kinds = [(g["kind"], g["weight_decay"]) for g in res["groups"]]
        assert kinds == [("muon", 0.0), ("muon", H["weight_decay"]),
                         ("adamw", H["adamw_weight_decay"])]
        # the schedule scaled each group's own lr
        assert res["groups"][1]["lr"] == pytest.approx(H["lr"] / 2 * lr_lambda(STEPS))


def test_checkpoint_with_groups_resumes_bit_identically(results):
    for res in results:
        for key, value in res["full"].items():
            assert torch.equal(res["resumed"][key], value), key


def test_bad_groups_are_refused_by_name(results):
    from torch import nn

    with pytest.raises(ValueError, match="dedicate_params"):
        dmuon.Muon([{"params": list(nn.Linear(2, 2).parameters())}])
    assert "param group 0 mixes dedicated (Muon) params with others" in results[0]["mixed"]
