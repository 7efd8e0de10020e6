"""The reference's quickstart (getting-started/quickstart.md) and its guides "Gradient
Accumulation" and "Z2 vs Z3 Modes" (/work/shared/reference/docs/): each usage's calls on 4
gloo ranks in float64, checked against a float64 single-process torch.optim.Muon + AdamW
run (dmuon.Muon's defaults here, docs/migration.md), an exact invariant or a formula
written here. One distributed run holds every set-up.

Usages tested elsewhere with the same calls (guide section: test):

- quickstart.md "Confirm the fast path" (`get_ns_backend()`):
  test_ns_backends.py::test_kernel_reports
- quickstart.md "Step 2", its import order (`from torch.distributed.fsdp import
  fully_shard` before `import dmuon`: FSDP2's own function, then refused by name):
  test_seeds.py::test_fully_shard_bound_before_import_names_the_param_and_the_fix
- z2-z3-modes.md "Byte cost per step" (the four configurations' formulas on one model):
  test_dmuon_core.py::test_ledger_bytes_per_step
- z2-z3-modes.md "Memory cost": test_dmuon_core.py::test_packed_buffer_memory_z2_and_z3
- grad-accumulation.md "How It Works" (`zero_grad` drops what `no_sync` held):
  test_zero_grad.py::test_zero_grad_discards_a_finished_backward
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.guides import (
    TinyMLP,
    TinyMLPBlocks,
    assert_matches,
    one_process,
    proj_predicate,
    tiny,
    torch_optimizers,
    two_step_reference,
)
from helpers.model import build_model, get_config
from helpers.train import global_batches, local_rows, loss_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.testing import run

WORLD, D, FF, QS_STEPS = 4, 32, 64, 20
QUICKSTART = dict(lr=0.02, momentum=0.95, ns_steps=5, adamw_lr=1e-3)


def _quickstart(rank, world, hsdp: bool) -> dict:
    """quickstart.md "Step 2", both tabs, as written but for gloo, float64 and D x FF."""
    # the guide imports this before `import dmuon`; here dmuon is imported first (this
    # module's top), as docs/migration.md asks: an earlier import is FSDP2's own function
    from torch.distributed.fsdp import fully_shard

    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        shard, extra = mesh["shard"], dict(replicate_mesh=mesh["replicate"])
    else:
        mesh = shard = init_device_mesh("cpu", (world,))
        extra = {}
    torch.manual_seed(42)
    model = TinyMLPBlocks(D, FF).to(torch.float64)
    dmuon.dedicate_params(model, shard, predicate=lambda n, p: "proj" in n and p.ndim == 2,
                          **extra)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, **QUICKSTART, **({"replicate_async": True} if hsdp else {}))
    losses = []
    for _ in range(QS_STEPS):
        optimizer.zero_grad()
        loss = model(torch.randn(4, D, dtype=torch.float64))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    names = {id(p): n for n, p in model.named_parameters()}
    # checkpoint.md "HSDP async drain is automatic": no wait before reading
    out = {"losses": losses, "sd": dmuon.get_model_state_dict(model),
           "dedicated": sorted(names[id(p)] for p in dmuon.get_dedicated_params(model)),
           "owned": sorted(names[id(p)] for p in dmuon.get_owned_params(model, rank=rank)),
           "fsdp": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
           "groups": [(g["use_muon"], len(g["params"])) for g in optimizer.param_groups]}
    out["held"] = {n: tuple(t.shape) for n, t in dmuon.get_state(model).owned_params.items()}
    return out


def _literal_model(world) -> str:
    """quickstart.md's TinyMLP itself: FSDP2 refuses its nn.ModuleDict layers."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = TinyMLP(D, FF).to(torch.float64)
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    try:
        fully_shard(model.layers[0], mesh=mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def _guides_setup(world: int, dmuon_z3: bool, fsdp_z3: bool):
    """The set-up both guides show: dedicate the projections (DMuon's
    `reshard_after_forward`), then `fully_shard` per layer and on the root (FSDP2's),
    then `dmuon.Muon`."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2,
                          reshard_after_forward=dmuon_z3)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=fsdp_z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=fsdp_z3)
    return model, dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)


def _accumulate(rank, world, z3: bool) -> dict:
    """grad-accumulation.md "Example: Full Training Loop with Accumulation" (Z3), and
    its DMuon-Z2 note: both flags False. The dataloader yields each rank's rows of a
    global batch, one row per micro-batch."""
    from contextlib import nullcontext

    model, optimizer = _guides_setup(world, z3, z3)
    accum_steps = 4
    dataloader = [row for batch in global_batches(2)
                  for row in local_rows(batch, rank, world).tensor_split(accum_steps)]
    losses, global_step = [], 0
    for i, batch in enumerate(dataloader):
        is_accumulating = (i + 1) % accum_steps != 0
        ctx = dmuon.no_sync(model) if is_accumulating else nullcontext()
        with ctx:
            loss = loss_of(model, batch) / accum_steps  # model(batch).loss / accum_steps
            loss.backward()
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
            losses.append(loss.item() * accum_steps)
    return {"full": dmuon.full_state_dict(model), "steps": global_step}


def _modes(rank, world, dmuon_z3: bool, fsdp_z3: bool) -> dict:
    """z2-z3-modes.md: `reshard_after_forward` for DMuon and FSDP2, symmetric and
    "Asymmetric configurations"; two steps, the last step's shard-dim bytes."""
    model, optimizer = _guides_setup(world, dmuon_z3, fsdp_z3)
    for batch in global_batches(2):
        optimizer.zero_grad()
        loss_of(model, local_rows(batch, rank, world)).backward()
        optimizer.step()
    ledger = dmuon.get_ledger(model).last_step_by_phase()["shard"]
    return {"full": dmuon.full_state_dict(model),
            "shard_bytes": sum(v for k, v in ledger.items() if k != "step")}


def _guides(rank, world) -> dict:
    return {"literal": _literal_model(world),
            "quickstart": {hsdp: _quickstart(rank, world, hsdp) for hsdp in (False, True)},
            "accumulate": {z3: _accumulate(rank, world, z3) for z3 in (True, False)},
            "modes": {(d, f): _modes(rank, world, d, f) for d in (True, False)
                      for f in (True, False)}}


@functools.cache
def _runs():
    return run(_guides, world_size=WORLD)


@functools.cache
def _two_steps():
    return two_step_reference()


@functools.cache
def _quickstart_reference():
    torch.manual_seed(42)
    model = TinyMLPBlocks(D, FF).to(torch.float64)
    return one_process(model, torch_optimizers(model, **QUICKSTART),
                       lambda m, _: m(torch.randn(4, D, dtype=torch.float64)), QS_STEPS)



# -- quickstart.md ----------------------------------------------------------------------

@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp2x2"])
def test_quickstart_matches_one_process(hsdp):
    """quickstart.md "Step 2", tabs "Single Node — FSDP2" and "Multi-Node — HSDP": 20
    steps of its loop against torch.optim.Muon + AdamW in one process; every rank draws
    the same batch (the guide seeds all ranks alike), so the average is that batch's."""
    ref, ref_losses = _quickstart_reference()
    results = _runs()
    for rank, res in enumerate(results):
        assert res["quickstart"][hsdp]["losses"] == pytest.approx(ref_losses, rel=1e-9), rank
    # get_model_state_dict: full tensors on rank 0 only (cpu_offload, rank0_only)
    assert_matches(results[0]["quickstart"][hsdp]["sd"], ref)
    assert all(res["quickstart"][hsdp]["sd"] == {} for res in results[1:])


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp2x2"])
def test_quickstart_what_just_happened(hsdp):
    """quickstart.md "What just happened?": each projection has one owner that holds it
    in full; FSDP2 shards ln.weight, ln.bias and head.weight; Muon steps the owned
    matrices, AdamW the FSDP2 params."""
    model = TinyMLPBlocks(D, FF)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    proj = sorted(n for n, p in model.named_parameters() if proj_predicate(n, p))
    results = [res["quickstart"][hsdp] for res in _runs()]
    owned = [name for res in results for name in res["owned"]]
    assert sorted(owned) == proj  # one owner each, over the whole layout
    for res in results:
        assert res["dedicated"] == proj
        assert res["fsdp"] == sorted(set(shapes) - set(proj))
        assert res["held"] == {n: shapes[n] for n in res["owned"]}
        assert res["groups"] == [(True, len(res["owned"])), (False, len(shapes) - len(proj))]


def test_quickstart_model_as_written_is_refused_by_fsdp2():
    """quickstart.md "Step 2", model.py: FSDP2 (torch 2.13) refuses `fully_shard` on its
    nn.ModuleDict layers, which have no forward; the tests above give each layer one
    (tests/helpers/guides.py: Block), with the same names and values."""
    assert "does not support containers that do not implement forward" in _runs()[0]["literal"]


# -- guides/grad-accumulation.md, guides/z2-z3-modes.md ------------------------------------

def test_grad_accumulation_matches_one_large_batch():
    """grad-accumulation.md "Basic Usage" and "Example: Full Training Loop": 4
    micro-batches, the first 3 under `no_sync`, loss / accum_steps, step on the 4th;
    against one process stepping each whole global batch, on DMuon-Z3 and (its "DMuon-Z2"
    note) Z2, which are bit-identical (z2-z3-modes.md)."""
    ref = _two_steps()
    for res in _runs():
        z3, z2 = res["accumulate"][True], res["accumulate"][False]
        assert z3["steps"] == z2["steps"] == 2
        assert_matches(z3["full"], ref)
        for key, value in z3["full"].items():
            assert torch.equal(value, z2["full"][key]), key


def test_z2_z3_symmetric_and_asymmetric_modes():
    """z2-z3-modes.md "The two packed-buffer lifecycles" and "Asymmetric
    configurations": DMuon's and FSDP2's reshard_after_forward in all four pairs match
    one process, bit-identically to each other; DMuon moves 3 (Z3) or 2 (Z2) x
    (N-1)/N x P_M x 8 bytes on the shard dim whatever FSDP2's flag."""
    ref = _two_steps()
    p_m = sum(p.numel() for n, p in tiny().named_parameters() if proj_predicate(n, p))
    for res in _runs():
        base = res["modes"][(True, True)]["full"]
        for (dmuon_z3, _), mode in res["modes"].items():
            assert_matches(mode["full"], ref)
            assert all(torch.equal(v, base[k]) for k, v in mode["full"].items())
            passes = 3 if dmuon_z3 else 2
            assert mode["shard_bytes"] == passes * (WORLD - 1) * p_m * 8 / WORLD
