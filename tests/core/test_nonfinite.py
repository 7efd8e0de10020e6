"""A non-finite gradient on one rank skips that step on every rank alike: 4 gloo ranks,
float64, Z2, Z3 and HSDP 2x2. Rank 2's loss turns NaN (or inf) at the chosen steps; the
run must end ``torch.equal`` to one that never saw those batches, name rank 2 and count
the skips on every rank, and issue the same collectives as ever (no hang, no mismatch).
"""

from __future__ import annotations

import pytest
import torch
from helpers.train import build_dmuon, global_batches, local_rows, loss_of

import dmuon
from dmuon.testing import run

STEPS, BAD = 6, {2: float("nan"), 4: float("inf")}
LAYOUTS = {"z2": ((1, 4), False), "z3": ((1, 4), True), "hsdp2x2": ((2, 2), True)}


def _train(rank, world, layout, z3, *, inject: bool):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    model, opt = build_dmuon(mesh["shard"], z3, replicate_mesh=mesh["replicate"],
                             fsdp_mesh=mesh)
    flagged = []
    for step, batch in enumerate(global_batches(STEPS)):
        if step in BAD and not inject:
            continue  # the run that never saw those batches
        loss = loss_of(model, local_rows(batch, rank, world))
        if step in BAD and rank == 2:
            loss = loss * BAD[step]
        loss.backward()
        opt.step()
        opt.zero_grad()
        flagged.append(list(opt.nonfinite_ranks))
    return {"final": dmuon.full_state_dict(model), "flagged": flagged,
            "skipped": opt.skipped_steps}


def _both(rank, world, layout, z3):
    return _train(rank, world, layout, z3, inject=True), \
        _train(rank, world, layout, z3, inject=False)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_nonfinite_step_on_one_rank_is_skipped_on_every_rank(name):
    layout, z3 = LAYOUTS[name]
    for rank, (injected, clean) in enumerate(run(_both, layout, z3, world_size=4)):
        assert injected["skipped"] == len(BAD) and clean["skipped"] == 0, rank
        assert injected["flagged"] == [[2] if s in BAD else [] for s in range(STEPS)], rank
        for key, value in clean["final"].items():
            assert torch.equal(injected["final"][key], value), (name, rank, key)


BLOWN = "model.layers.1.mlp.up_proj.weight"


def _blown_update(rank, world):
    """One matrix's NS overflows (its group's coefficients grow it by 1e100 an
    iteration) on its owner only: its gradient, and every other rank's, is finite."""
    from helpers.model import build_model, get_config, muon_predicate
    from helpers.train import HPARAMS
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    plan = dmuon.dedicate_params(model, mesh, predicate=muon_predicate)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    initial = dmuon.full_state_dict(model)
    blown = model.get_parameter(BLOWN)
    dedicated = dmuon.ignored_params(model)  # the dedicated params (FSDP2 skips them)
    groups = [{"params": [blown], "ns_coefficients": (1e100, 0.0, 0.0)},
              {"params": [p for p in dmuon.get_dedicated_params(model) if p is not blown]},
              {"params": [p for p in model.parameters() if p not in dedicated]}]
    opt = dmuon.Muon(groups, **HPARAMS, ns_dtype=torch.float64)
    flagged = []
    for batch in global_batches(2):
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        flagged.append(list(opt.nonfinite_ranks))
    return {"initial": initial, "final": dmuon.full_state_dict(model), "flagged": flagged,
            "skipped": opt.skipped_steps, "owner": plan.params[BLOWN].owner}


def test_a_nonfinite_update_on_its_owner_is_skipped_on_every_rank():
    results = run(_blown_update, world_size=4)
    assert {r["owner"] for r in results} == {results[0]["owner"]}
    for rank, res in enumerate(results):
        assert res["skipped"] == 2 and res["flagged"] == [["update"], ["update"]], rank
        for key, value in res["initial"].items():  # nothing moved: Muon, AdamW alike
            assert torch.equal(res["final"][key], value), (rank, key)


# -- fp16: a finite gradient whose sum passes 65,504 is finite ---------------------------
FP16_ELEMENT = 1.0e3  # 256 elements: the sum is 2.56e5, past fp16's largest finite 65,504


def _fp16_steps(rank, world):
    from helpers.model import dedicated_fp16_matrix

    model = dedicated_fp16_matrix(world)
    opt = dmuon.Muon(model, lr=1e-3, ns_dtype=torch.float32)
    flagged = []
    for scale in (FP16_ELEMENT, float("inf")):
        # d/dW of sum(scale * W x), x all ones: ``scale`` in every element on every rank
        (model(torch.ones(1, 16, dtype=torch.float16)) * scale).sum().backward()
        opt.step()
        opt.zero_grad()
        flagged.append(list(opt.nonfinite_ranks))
    return {"flagged": flagged, "skipped": opt.skipped_steps}


def test_fp16_finite_gradients_summing_past_65504_are_not_skipped():
    """Each rank's fp16 gradient is finite with a sum of 2.56e5; the reduced mean is too.
    Flagged from an fp16 sum, both ranks were named and the step skipped; a real inf in
    the next step must still skip on every rank."""
    for rank, result in enumerate(run(_fp16_steps, world_size=2)):
        assert result["flagged"] == [[], [0, 1]], rank
        assert result["skipped"] == 1, rank


def test_finiteness_flags_sum_wider_than_fp16():
    from dmuon.nonfinite import count_nonfinite, is_nonfinite

    big = torch.full((64, 64), 6.0e4, dtype=torch.float16)  # every element finite
    assert big.sum().isinf()  # the fp16 sum the flags used to read
    assert not is_nonfinite(big) and not is_nonfinite(big.bfloat16())
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = big.clone()
        t[3, 5] = bad
        assert is_nonfinite(t)
        assert count_nonfinite([big, t, t.double()]).item() == 2.0
    assert count_nonfinite([]) is None
