"""``dmuon.get/set_model_state_dict`` and ``get/set_optimizer_state_dict`` (the reference's
names, torch.distributed.checkpoint.state_dict's options) on Z2, Z3 and HSDP 2x2, 4 gloo
ranks, float64, each against something independent:

- the full model state dict equals, bitwise, what torch's ``get_model_state_dict`` gives
  for an FSDP2-only twin built with the same seed;
- pretrained full weights (another seed's single-process ``state_dict()``) load bitwise
  into every rank's owned matrices and FSDP2 shards (checked against ``torch.chunk`` of the
  source), allocating at most one boundary's packed buffer on top of the rank's share;
- the full optimizer state after 3 steps equals torch.optim.Muon's and AdamW's in one
  float64 process within 1e-9;
- a run resumed from full or sharded state dicts after 3 steps ends ``torch.equal`` to the
  uninterrupted one; a strict load that does not fit is refused before anything changes.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.memory import PeakNewBytes
from helpers.model import build_model, get_config, muon_predicate
from helpers.train import (
    build_dmuon,
    global_batches,
    local_rows,
    loss_of,
    reference_ns,
    reference_optimizers,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions

import dmuon
from dmuon.testing import run

STEPS, RESUME_AT = 5, 3
LAYOUTS = {"z2": ((1, 4), False), "z3": ((1, 4), True), "hsdp2x2": ((2, 2), True)}
FULL = StateDictOptions(full_state_dict=True)


def _meshes(layout):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    return mesh, mesh["shard"], mesh["replicate"]


def _build(layout, z3):
    mesh, shard, replicate = _meshes(layout)
    return build_dmuon(shard, z3, replicate_mesh=replicate, fsdp_mesh=mesh)


def _steps(model, opt, rank, world, start, stop):
    for batch in global_batches(STEPS)[start:stop]:
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()


def _twin_full_state_dict(layout):
    """torch's own full state dict of an FSDP2-only model with the same seed."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    mesh, _, _ = _meshes(layout)
    twin = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    for layer in twin.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(twin, mesh=mesh)
    return get_model_state_dict(twin, options=FULL)


def _pretrained_load(rank, world, layout, z3):
    model, _ = _build(layout, z3)
    state = dmuon.get_state(model)
    source = build_model(get_config("tiny"), dtype=torch.float64, seed=123).state_dict()
    with PeakNewBytes() as peak:
        keys = dmuon.set_model_state_dict(model, source)
    shard = state.ctx.shard_rank
    owned_ok = all(torch.equal(t, source[state.plan.params[u].param])
                   for u, t in state.owned_params.items())
    shards_ok = all(torch.equal(p.to_local(), source[n].chunk(layout[1])[shard])
                    for n, p in model.named_parameters() if hasattr(p, "to_local"))
    boundary_bytes = max(b.numel * b.packed.element_size() for b in state.boundaries)
    full = dmuon.full_state_dict(model)
    return {"keys": keys, "owned_ok": owned_ok and bool(state.owned_params),
            "shards_ok": shards_ok, "peak": peak.peak, "boundary_bytes": boundary_bytes,
            "equal_source": full.keys() == source.keys() and all(
                torch.equal(full[k], v) for k, v in source.items())}


def _resume(rank, world, layout, z3, options):
    model, opt = _build(layout, z3)
    _steps(model, opt, rank, world, 0, RESUME_AT)
    model_sd = dmuon.get_model_state_dict(model, options=options)
    optim_sd = dmuon.get_optimizer_state_dict(model, opt, options=options)
    fresh, fresh_opt = _build(layout, z3)
    dmuon.set_model_state_dict(fresh, model_sd, options=options)
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, optim_sd, options=options)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        _steps(m, o, rank, world, RESUME_AT, STEPS)
    return dmuon.full_state_dict(model), dmuon.full_state_dict(fresh)


def _strict_refusal(model):
    before = dmuon.full_state_dict(model)
    partial = dict(before)
    partial.pop("model.norm.weight")
    partial["model.layers.0.self_attn.q_proj.weight"] = torch.zeros_like(
        partial["model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(RuntimeError) as e:
        dmuon.set_model_state_dict(model, partial, options=FULL)
    after = dmuon.full_state_dict(model)
    return str(e.value), all(torch.equal(after[k], v) for k, v in before.items())


def _all(rank, world, layout, z3):
    out = {"twin": _twin_full_state_dict(layout)}
    model, opt = _build(layout, z3)
    out["full"] = dmuon.get_model_state_dict(model, options=FULL)
    out["default"] = dmuon.get_model_state_dict(model)  # the reference's: rank 0, CPU
    _steps(model, opt, rank, world, 0, RESUME_AT)
    out["optim"] = dmuon.get_optimizer_state_dict(model, opt, options=FULL)
    out["strict"] = _strict_refusal(model)
    out["pretrained"] = _pretrained_load(rank, world, layout, z3)
    out["resumed"] = {"full": _resume(rank, world, layout, z3, FULL),
                      "sharded": _resume(rank, world, layout, z3,
                                         StateDictOptions(full_state_dict=False))}
    return out


@functools.cache
def _runs(name):
    layout, z3 = LAYOUTS[name]
    return run(_all, layout, z3, world_size=4)


@functools.cache
def _reference_optimizer_state():
    """torch.optim.Muon + AdamW in one float64 process after RESUME_AT steps."""
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    named = dict(model.named_parameters())
    muon = [p for n, p in named.items() if muon_predicate(n, p)]
    opts = reference_optimizers(muon, [p for n, p in named.items() if not muon_predicate(n, p)])
    with reference_ns():
        for batch in global_batches(STEPS)[:RESUME_AT]:
            loss_of(model, batch).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    names = {id(p): n for n, p in named.items()}
    return {names[id(p)]: s for o in opts for p, s in o.state.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_full_model_state_dict_equals_dcp_on_an_fsdp2_only_twin(name):
    for rank, res in enumerate(_runs(name)):
        assert res["full"].keys() == res["twin"].keys()
        for key, value in res["twin"].items():
            assert torch.equal(res["full"][key], value), (rank, key)
        if rank == 0:
            assert all(v.device.type == "cpu" and torch.equal(v, res["twin"][k])
                       for k, v in res["default"].items()) and res["default"]
        else:
            assert res["default"] == {}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pretrained_full_weights_load_bitwise_within_one_boundary(name):
    for rank, res in enumerate(_runs(name)):
        p = res["pretrained"]
        assert p["keys"].missing_keys == [] and p["keys"].unexpected_keys == []
        assert p["equal_source"] and p["shards_ok"], rank
        assert p["owned_ok"], rank
        assert p["peak"] <= p["boundary_bytes"], (rank, p["peak"], p["boundary_bytes"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_full_optimizer_state_matches_torch_muon_and_adamw(name):
    ref = _reference_optimizer_state()
    for rank, res in enumerate(_runs(name)):
        state = res["optim"]["state"]
        assert state.keys() == ref.keys()
        for key, tensors in ref.items():
            for k, value in tensors.items():
                got = state[key][k]
                err = ((got - value).abs().max() / value.abs().max().clamp(min=1e-300)).item()
                assert err <= 1e-9, (rank, key, k, err)
        names = sorted(n for g in res["optim"]["param_groups"] for n in g["params"])
        assert names == sorted(ref)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resumed_from_state_dicts_equals_uninterrupted(name):
    for rank, res in enumerate(_runs(name)):
        for form, (uninterrupted, resumed) in res["resumed"].items():
            for key, value in uninterrupted.items():
                assert torch.equal(resumed[key], value), (rank, form, key)


def test_strict_load_that_does_not_fit_is_refused_before_any_write():
    for res in _runs("z3"):
        message, unchanged = res["strict"]
        assert "missing keys ['model.norm.weight']" in message and unchanged
