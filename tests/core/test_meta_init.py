"""Meta-device init: a model built on ``torch.device("meta")``, dedicated and fully
sharded there, then ``dmuon.materialize``d: the values equal the same model initialised
in full on one process by the same rule. What each rank allocates, against the planner's
share of it: tests/job/test_meta_init_plan.py."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.model import build_model, get_config, init_builtin, muon_predicate
from helpers.train import global_batches, local_rows, loss_of, materialized_from_meta

import dmuon
from dmuon.testing import run

SEED = 7


def _setup(layout, config):
    return materialized_from_meta(build_model(config, device="meta"), layout, muon_predicate,
                                  seed=SEED, init_fn=init_builtin)


def _values(rank, world, layout):
    model = _setup(layout, get_config("small"))
    full = dmuon.full_state_dict(model)
    opt = dmuon.Muon(model, ns_dtype=torch.float64)  # and it trains
    loss_of(model, local_rows(global_batches(1)[0], rank, world)).backward()
    opt.step()
    return full


@functools.cache
def reference():
    return {k: v.detach() for k, v in build_model("small", seed=SEED).state_dict().items()}


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
def test_meta_init_equals_the_full_init_of_one_process(layout):
    """The rule, re-stated here independently: each module with params, in
    named_modules order, initialised by init_builtin under manual_seed(unit_seed(seed,
    its FQN)) -- done by build_model on a whole model in one process."""
    ref = reference()
    for res in run(_values, layout, world_size=4):
        assert set(res) == set(ref)
        for key, value in ref.items():
            assert torch.equal(res[key], value), key


def test_unit_seeds_are_the_documented_hash():
    import hashlib

    digest = hashlib.blake2b(b"7:model.layers.0.mlp.up_proj", digest_size=8).digest()
    assert dmuon.unit_seed(7, "model.layers.0.mlp.up_proj") == \
        int.from_bytes(digest, "little") & ((1 << 63) - 1)
    a, b = build_model("tiny", seed=1), build_model("tiny", seed=2)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def _replaced_then_forward(rank, world):
    """A model dedicated with its values, then one Muon matrix given new storage (what a
    plain ``to_empty`` or TP applied after ``dedicate_params`` does to each param)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = build_model("small", seed=SEED)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    dmuon.dedicate_params(model, mesh, predicate=muon_predicate)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    replaced = "model.layers.1.mlp.up_proj.weight"
    param = model.get_parameter(replaced)
    param.data = torch.zeros_like(param)
    try:
        loss_of(model, local_rows(global_batches(1)[0], rank, world))
    except RuntimeError as e:
        return replaced, str(e)
    return replaced, None


def test_a_matrix_no_longer_viewing_the_packed_buffer_is_refused_by_name():
    """Every rank refuses the first forward, naming the param, instead of computing with
    values DMuon never fills."""
    for replaced, error in run(_replaced_then_forward, world_size=2):
        assert error is not None and error.startswith(
            f"'{replaced}' no longer views DMuon's packed buffer"), error
