"""Checkpoints under a pipeline (issue 52): each stage keeps the model's FQNs, so a
checkpoint saved by ``dmuon.checkpoint.save(path, stage_modules, PipelineMuon)`` on PP 2
x FSDP 2 (4 gloo ranks, 4-layer built-in model, float64, after 5 of 10 steps) holds the
whole model's keys, and loads on the whole model without a pipeline (PP 1, FSDP 4), on
PP 4 (one layer a stage) and on PP 2 interleaved (stages p and p + 2 on each rank):
every param, momentum and AdamW tensor bitwise equal to what was saved, and the 5 steps
after within 1e-9 of the single-process float64 reference (which trained through)."""

from __future__ import annotations

import pytest
import torch
from helpers.pipeline import CONFIG, pp_train
from helpers.train import build_dmuon, global_batches, local_rows, loss_of, lr_lambda, reference_run

import dmuon
from dmuon.testing import run

STEPS, SAVE_AT = 10, 5


def _merged(results: list[dict], key: str) -> dict:
    """Each key's value over the ranks (a momentum lives on its owner alone), checked
    bitwise equal on every rank that holds it."""
    out: dict = {}
    for rank, r in enumerate(results):
        for k, value in r[key].items():
            assert k not in out or torch.equal(out[k], value), (rank, k)
            out[k] = value
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pp") / "ckpt")
    return path, run(pp_train, path=path, save_at=SAVE_AT, steps=STEPS, world_size=4)


@pytest.fixture(scope="module")
def reference():
    return reference_run(STEPS, config=CONFIG)


def _whole_model(rank, world, path):
    """PP 1: the whole model, dmuon.Muon over FSDP 4, resumed from the pipeline's
    checkpoint by the ordinary dmuon.checkpoint.load."""
    from helpers.train import optimizer_snapshot
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model, opt = build_dmuon(mesh, False, config=CONFIG)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    start = sched.last_epoch = dmuon.checkpoint.load(path, model, opt)["step"]
    loaded = {**dmuon.full_state_dict(model),
              **{f"optim/{k}": v for k, v in optimizer_snapshot(model, opt).items()}}
    for batch in global_batches(STEPS, CONFIG.vocab_size)[start:]:
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"loaded": loaded, "final": dmuon.full_state_dict(model), "losses": None}


def test_the_checkpoint_holds_the_whole_models_keys(saved, reference):
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(saved[0]).read_metadata().state_dict_metadata)
    params, _ = reference
    assert {k[len("model/"):] for k in keys if k.startswith("model/")} == set(params)
    for fqn in params:  # the 2-D matrices' momentum, AdamW's moments for the rest
        names = ("momentum_buffer",) if ".layers." in fqn and params[fqn].ndim == 2 \
            else ("step", "exp_avg", "exp_avg_sq")
        assert {f"optim/{fqn}/{n}" for n in names} <= keys, fqn


def test_the_pipeline_trained_through_its_save(saved, reference):
    _, results = saved
    params, losses = reference
    got = _merged(results, "final")
    for fqn, value in params.items():
        err = ((got[fqn] - value).abs().max() / value.abs().max()).item()
        assert err <= 1e-9, (fqn, err)
    assert results[0]["losses"] == pytest.approx(losses, rel=1e-9)


TARGETS = {
    "pp1_whole_model": (_whole_model, {}),
    "pp4": (pp_train, {"pp": 4, "split": "four"}),
    "pp2_interleaved": (pp_train, {"schedule": "interleaved", "split": "four"}),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_a_pp2_checkpoint_loads_bitwise_elsewhere_and_trains_on(saved, reference, target):
    path, on_pp2 = saved
    fn, kwargs = TARGETS[target]
    if fn is pp_train:
        kwargs = {**kwargs, "path": path, "load": True, "steps": STEPS}
        results = run(fn, world_size=4, **kwargs)
    else:
        results = run(fn, path, world_size=4)
    want, got = _merged(on_pp2, "saved"), _merged(results, "loaded")
    assert sorted(got) == sorted(want)
    assert any(k.startswith("optim/momentum/") for k in got)
    for k, value in want.items():
        assert torch.equal(got[k], value), k
    params, losses = reference
    final = _merged(results, "final")
    for fqn, value in params.items():
        err = ((final[fqn] - value).abs().max() / value.abs().max()).item()
        assert err <= 1e-9, (target, fqn, err)
    if results[0]["losses"] is not None:
        assert results[0]["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-9)


def _state_dict_round_trip(rank, world):
    from helpers.pipeline import build

    from dmuon.full_state import raw_state_dict

    mesh, stages, opt, schedule = build("1f1b", "two", False, 4)
    batch = local_rows(global_batches(1)[0], mesh["shard"].get_local_rank(), 2)
    kwargs = {"target": batch[:, 1:], "losses": []} if stages[0].is_last else {}
    schedule.step(*((batch[:, :-1],) if stages[0].is_first else ()), **kwargs)
    opt.step()
    sd = opt.state_dict()
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    kept = {k: {n: t.clone() for n, t in s.items()} for k, s in sd["state"].items()}
    for s in sd["state"].values():
        for t in s.values():
            local(t).zero_()
    opt.load_state_dict({"state": kept, "param_groups": sd["param_groups"]})
    after = opt.state_dict()["state"]
    same = [torch.equal(local(after[k][n]), local(v)) for k, s in kept.items()
            for n, v in s.items()]  # DTensor's torch.equal would be a collective
    return {"keys": sorted(sd["state"]), "fqns": sorted(raw_state_dict(stages[0].submod)),
            "kinds": [g["kind"] for g in sd["param_groups"]], "same": all(same),
            "lrs": [g["lr"] for g in sd["param_groups"]]}


def test_pipeline_muon_state_dict_is_keyed_by_the_models_fqns():
    """``PipelineMuon.state_dict``: this rank's stages' state under the whole model's
    FQNs (a momentum on its owner alone), the groups one per kind; ``load_state_dict``
    of it on the same layout brings every tensor back bitwise."""
    results = run(_state_dict_round_trip, world_size=4)
    for rank, r in enumerate(results):
        assert r["kinds"] == ["muon", "adamw"], rank
        assert r["lrs"] == [0.02, 3e-3], rank
        assert r["same"], rank
        assert set(r["keys"]) <= set(r["fqns"]) and r["keys"], rank
    for stage in (0, 1):  # every FQN of the stage over its two ranks
        ranks = results[2 * stage:2 * stage + 2]
        assert set(ranks[0]["keys"]) | set(ranks[1]["keys"]) == set(ranks[0]["fqns"])
