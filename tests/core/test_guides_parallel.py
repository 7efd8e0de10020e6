"""The reference's guides ``guides/hsdp.md`` and ``guides/tp-support.md``, their code
done with the same dmuon calls and keywords on 4 gloo ranks (the tiny model in float64,
``ns_dtype=torch.float64`` added so that the comparison can be to 1e-9), each against the
float64 single-process reference (torch.optim.Muon + AdamW at the guides' settings) or an
exact invariant. Usages tested elsewhere, with the same calls:

- hsdp.md "Sync vs Async Mode", 10 steps:
  test_hsdp.py::test_async_and_sync_replicate_broadcast_are_bit_identical
- hsdp.md "DMuon-Z2 vs DMuon-Z3", 10 steps:
  test_hsdp.py::test_hsdp_matches_float64_reference
- tp-support.md "Requirements" 3, the call order:
  test_tp.py::test_tp_after_dedicate_is_refused_by_name
- tp-support.md "DDP + TP" with a route policy:
  test_routing.py::test_pure_dmuon_on_ddp_x_tp
- tp-support.md "3D mesh: HSDP x TP" on 2 x 2 x 2 (8 ranks): test_3d.py

``fully_shard`` is the guides' import, after helpers.model's ``import dmuon``: the name
is then dmuon's (docs/migration.md), which skips the dedicated params.

Usages that cannot run on gloo (the CUDA device id of "Troubleshooting", the torchrun
test files of "Correctness Guarantees", ``tp_buffer_reuse``) are listed in
docs/migration.md.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from helpers.model import build_model, get_config
from helpers.train import global_batches, local_rows, loss_of, reference_ns
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.testing import run

STEPS, WORLD = 3, 4
# dmuon.Muon's defaults the guides rely on, written as torch's optimizers take them
GUIDE_MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0)
GUIDE_ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def proj(n, p):
    """The guides' predicate."""
    return "proj" in n and p.ndim == 2


def tiny(seed=0):
    return build_model(get_config("tiny"), dtype=torch.float64, seed=seed)


def train(model, opt, dp_rank, dp_world, steps=STEPS, start=0):
    """The guides' loop: zero_grad, forward on this data-parallel rank's rows, backward,
    step."""
    for batch in global_batches(steps)[start:]:
        opt.zero_grad()
        loss_of(model, local_rows(batch, dp_rank, dp_world)).backward()
        opt.step()
    return dmuon.full_state_dict(model)


@functools.cache
def reference(steps=STEPS):
    """One process, the whole batch: torch.optim.Muon on the guides' matrices, AdamW on
    the rest, at dmuon.Muon's defaults; Newton-Schulz in float64."""
    model = tiny()
    named = dict(model.named_parameters())
    opts = [torch.optim.Muon([p for n, p in named.items() if proj(n, p)], **GUIDE_MUON),
            torch.optim.AdamW([p for n, p in named.items() if not proj(n, p)], **GUIDE_ADAMW)]
    with reference_ns():
        for batch in global_batches(steps):
            loss_of(model, batch).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close(full, ref, bound=1e-9):
    assert set(full) == set(ref)
    for key, value in ref.items():
        err = ((full[key] - value).abs().max() / value.abs().max()).item()
        assert err <= bound, (key, err)


# -- guides/hsdp.md ------------------------------------------------------------------------

def _hsdp_model(hsdp, seed=0, dmuon_z2=False, fsdp_z2=False, replicate_async=True):
    """hsdp.md "TL;DR": ``dedicate_params`` on the shard dim with ``replicate_mesh``,
    FSDP2 on the 2-D mesh; ``reshard_after_forward=False`` where "DMuon-Z2 vs DMuon-Z3"
    sets it (on dmuon, on FSDP2, or both)."""
    model = tiny(seed)
    z2 = {"reshard_after_forward": False}
    dmuon.dedicate_params(model, hsdp["shard"], predicate=lambda n, p: "proj" in n and p.ndim == 2,
                          replicate_mesh=hsdp["replicate"], **(z2 if dmuon_z2 else {}))
    for layer in model.model.layers:
        fully_shard(layer, mesh=hsdp, **(z2 if fsdp_z2 else {}))
    fully_shard(model, mesh=hsdp)
    return model, dmuon.Muon(model, lr=0.02, momentum=0.95, replicate_async=replicate_async,
                             ns_dtype=torch.float64)


def _hsdp_checkpoint(model, opt, hsdp, path, rank):
    """hsdp.md "Checkpointing under HSDP": save after step 2, a fresh model (other seed)
    restored from the file trains step 3."""
    model_sd = dmuon.get_model_state_dict(model)  # drains async broadcast first
    optim_sd = dmuon.get_optimizer_state_dict(model, opt)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, path)
    dist.barrier()  # the file is rank 0's: the others read it once it is written
    fresh, fresh_opt = _hsdp_model(hsdp, seed=1)
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    dmuon.set_model_state_dict(fresh, ckpt["model"])
    dmuon.set_optimizer_state_dict(fresh, fresh_opt, ckpt["optim"])
    return train(fresh, fresh_opt, rank, WORLD, start=STEPS - 1)


def _hsdp(rank, world, path):
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    model, opt = _hsdp_model(hsdp)
    train(model, opt, rank, world, steps=STEPS - 1)
    out["restored"] = _hsdp_checkpoint(model, opt, hsdp, path, rank)
    out["async"] = train(model, opt, rank, world, start=STEPS - 1)
    # integration-recipes.md "manual_overrides.py": drain, then the model's state dict
    dmuon.wait_all_replicate_broadcasts(model)
    out["drained"] = dmuon.get_model_state_dict(model)
    out["sync"] = train(*_hsdp_model(hsdp, replicate_async=False), rank, world)
    out["z2"] = train(*_hsdp_model(hsdp, dmuon_z2=True, fsdp_z2=True), rank, world)
    out["z2_fsdp_z3"] = train(*_hsdp_model(hsdp, dmuon_z2=True), rank, world)
    out["z3_fsdp_z2"] = train(*_hsdp_model(hsdp, fsdp_z2=True), rank, world)
    return out


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    return run(_hsdp, str(tmp_path_factory.mktemp("hsdp") / "ckpt.pt"), world_size=WORLD)


def test_hsdp_tldr_matches_the_float64_reference(hsdp_runs):
    """guides/hsdp.md, "TL;DR — 5-Line HSDP Integration": the 2-D (replicate, shard)
    mesh, ``dedicate_params(..., replicate_mesh=...)``, ``fully_shard(layer, mesh=hsdp)``,
    ``Muon(lr=0.02, momentum=0.95, replicate_async=True)``, the loop unchanged."""
    for res in hsdp_runs:
        assert_close(res["async"], reference())


def test_hsdp_sync_mode_is_bit_identical_to_async(hsdp_runs):
    """guides/hsdp.md, "Sync vs Async Mode": ``replicate_async=False`` is bit-identical."""
    for res in hsdp_runs:
        for key, value in res["async"].items():
            assert torch.equal(res["sync"][key], value), key


@pytest.mark.parametrize("variant", ["z2", "z2_fsdp_z3", "z3_fsdp_z2"])
def test_hsdp_z2_z3_combinations_match_the_reference(hsdp_runs, variant):
    """guides/hsdp.md, "DMuon-Z2 vs DMuon-Z3 (packed-buffer lifecycle)": DMuon's
    ``reshard_after_forward=False`` with FSDP2's (the "Fully ZeRO-2" rule of thumb), and
    the asymmetric combinations the section calls valid."""
    for res in hsdp_runs:
        assert_close(res[variant], reference())


def test_hsdp_checkpoint_restore_continues_bit_identically(hsdp_runs):
    """guides/hsdp.md, "Checkpointing under HSDP": ``get_model_state_dict`` /
    ``get_optimizer_state_dict`` saved by rank 0, ``torch.load`` and the two setters on
    the same topology; step 3 from the file equals step 3 of the run that saved it."""
    for res in hsdp_runs:
        for key, value in res["async"].items():
            assert torch.equal(res["restored"][key], value), key


def test_drained_model_state_dict_is_the_reference(hsdp_runs):
    """guides/integration-recipes.md, "Custom training loops" (manual_overrides.py):
    ``wait_all_replicate_broadcasts(model)`` then ``get_model_state_dict(model)`` after an
    async step: rank 0 gets every param at its value after the step."""
    assert_close(hsdp_runs[0]["drained"], reference())
    assert all(res["drained"] == {} for res in hsdp_runs[1:])  # rank0_only=True


# -- guides/tp-support.md ------------------------------------------------------------------

def _colwise_rowwise(colwise, rowwise, prefix=""):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{prefix + n: ColwiseParallel() for n in colwise},
            **{prefix + n: RowwiseParallel() for n in rowwise}}


ATTN = (("q_proj", "k_proj", "v_proj"), ("o_proj",))
MLP = (("gate_proj", "up_proj"), ("down_proj",))


def _tp_setup(mesh, **muon_kwargs):
    """tp-support.md "Setup": TP on each layer's attention and MLP, then DMuon and FSDP2
    on ``mesh["dp"]``, then ``Muon``; ``muon_kwargs`` in place of the guide's when given."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = tiny()
    for layer in model.model.layers:  # Step 1 — TP
        parallelize_module(layer.self_attn, mesh["tp"], _colwise_rowwise(*ATTN))
        parallelize_module(layer.mlp, mesh["tp"], _colwise_rowwise(*MLP))
    dmuon.dedicate_params(model, mesh["dp"],  # Step 2 — DMuon
                          predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.model.layers:  # Step 3 — FSDP2
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    kwargs = muon_kwargs or dict(lr=0.02, momentum=0.95, adamw_lr=1e-3)
    return model, dmuon.Muon(model, **kwargs, ns_dtype=torch.float64)


def _ddp_tp(mesh):
    """tp-support.md "DDP + TP": one TP plan for the whole model, then
    ``dedicate_params_ddp_tp`` and ``replicate_tp`` on the DP row."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = tiny()
    plan = {**_colwise_rowwise(*ATTN, prefix="model.layers.*.self_attn."),
            **_colwise_rowwise(*MLP, prefix="model.layers.*.mlp.")}
    parallelize_module(model, mesh["tp"], plan)  # TP first
    dmuon.dedicate_params_ddp_tp(model, mesh["dp"], predicate=proj)
    dmuon.replicate_tp(model, mesh["dp"])  # non-dedicated params
    return model, dmuon.Muon(model, lr=0.02, ns_dtype=torch.float64)


def _inspect(model):
    """tp-support.md "Inspecting TP properties", the guide's loop."""
    rows = []
    for dp in dmuon.get_owned_params(model, rank=dist.get_rank()):
        rows.append((dp.param_name, tuple(dp._orig_size), tuple(dp.full_shape), dp.shard_dim,
                     dp.is_tp_owner, dp.tp_group.size() if dp.tp_group else 1))
    return rows


def _inspect_here(model):
    """The same facts as docs/migration.md's ``get_owned_params`` line gives them: the
    owned params are the module's DTensors (local and full shape, the TP dim and group
    size from their placements and mesh)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], tuple(p.to_local().shape), tuple(p.shape),
             p.placements[0].dim, p.device_mesh.size())
            for p in dmuon.get_owned_params(model, rank=dist.get_rank())]


def _attempt(call):
    """``call()``'s result, or the exception it raised as ``(type name, message)``."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the test reports what the guide's call did
        return (type(e).__name__, str(e))


def _tp(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    out = {}
    model, opt = _tp_setup(mesh)
    out["setup"] = train(model, opt, dp_rank, 2)
    out["inspect"] = _attempt(lambda: _inspect(model))
    out["inspect_here"] = _inspect_here(model)
    out["default"] = train(*_tp_setup(mesh, lr=0.02), dp_rank, 2)
    out["sync"] = train(*_tp_setup(mesh, lr=0.02, replicate_async=False), dp_rank, 2)
    out["gram"] = _attempt(lambda: train(*_tp_setup(mesh, lr=0.02, tp_distributed_gram=True),
                                         dp_rank, 2))
    out["ddp_tp"] = train(*_ddp_tp(mesh), dp_rank, 2)
    return out


@functools.cache
def tp_runs():
    return run(_tp, world_size=WORLD)


def test_tp_setup_matches_the_float64_reference():
    """guides/tp-support.md, "Setup": ``parallelize_module`` on ``self_attn`` and ``mlp``
    with the guide's Colwise/Rowwise plan on ``mesh["tp"]``, ``dedicate_params`` and
    ``fully_shard`` on ``mesh["dp"]``, ``Muon(lr=0.02, momentum=0.95, adamw_lr=1e-3)``:
    NS on the full matrices, so one process's Muon to 1e-9."""
    for res in tp_runs():
        assert_close(res["setup"], reference())


def test_tp_sync_and_default_post_step_are_the_same():
    """guides/tp-support.md, "Sync vs async post-step": ``Muon(model, lr=0.02)`` and
    ``Muon(model, lr=0.02, replicate_async=False)`` give the same values, the
    reference's."""
    for res in tp_runs():
        assert_close(res["default"], reference())
        for key, value in res["default"].items():
            assert torch.equal(res["sync"][key], value), key


def test_ddp_tp_matches_the_float64_reference():
    """guides/tp-support.md, "DDP + TP": ``parallelize_module(model, mesh["tp"], plan)``,
    ``dedicate_params_ddp_tp(model, mesh["dp"], predicate=...)``,
    ``replicate_tp(model, mesh["dp"])``, ``Muon(model, lr=0.02)``."""
    for res in tp_runs():
        assert_close(res["ddp_tp"], reference())


def test_tp_distributed_gram_knob_is_refused_by_name():
    """guides/tp-support.md, "Runtime knobs": ``Muon(..., tp_distributed_gram=True)`` is
    refused (docs/migration.md: "refused, because" the Gram rule on TP shards has no knob
    here): a TypeError that names the keyword, before any step."""
    for res in tp_runs():
        kind, message = res["gram"]
        assert kind == "TypeError" and "tp_distributed_gram" in message, res["gram"]


def test_inspecting_tp_properties():
    """guides/tp-support.md, "Inspecting TP properties": the guide's loop reads the
    reference's DedicatedParam fields, which the module's params here do not have
    (docs/migration.md, ``get_owned_params``: "different"); the same facts from the
    DTensors themselves: each owned param's local shape is half its full shape on its
    TP dim, over a TP group of 2, and every projection is owned somewhere."""
    runs = tp_runs()
    shapes = {n: tuple(p.shape) for n, p in tiny().named_parameters() if proj(n, p)}
    owned = set()
    for res in runs:
        assert res["inspect"][0] == "AttributeError", res["inspect"]
        for name, local, full, shard_dim, tp_size in res["inspect_here"]:
            assert full == shapes[name] and tp_size == 2 and shard_dim in (0, 1)
            assert local[shard_dim] * 2 == full[shard_dim]
            owned.add(name)
    assert owned == set(shapes)


def _one_d(mesh):
    model = tiny()
    dmuon.dedicate_params(model, mesh, predicate=proj)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dmuon.Muon(model, lr=0.02, momentum=0.95, adamw_lr=1e-3,
                             ns_dtype=torch.float64)


def _hsdp_tp(mesh3d):
    """tp-support.md "3D mesh: HSDP x TP": TP, DMuon on shard + replicate, FSDP2 on the
    2-D DP slice, ``Muon(model, lr=0.02)``."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = tiny()
    plan = {**_colwise_rowwise(*ATTN, prefix="model.layers.*.self_attn."),
            **_colwise_rowwise(*MLP, prefix="model.layers.*.mlp.")}
    parallelize_module(model, mesh3d["tp"], plan)  # Step 1 — TP
    dmuon.dedicate_params(model, mesh=mesh3d["shard"], replicate_mesh=mesh3d["replicate"],
                          predicate=proj)  # Step 2 — DMuon (DP = replicate x shard)
    fully_shard(model, mesh=mesh3d["replicate", "shard"])  # Step 3 — FSDP2
    return model, dmuon.Muon(model, lr=0.02, ns_dtype=torch.float64)


def _two_d_tp(world):
    """tp-support.md "Limitations": a dedicated param sharded over a 2-D TP mesh."""
    from torch.distributed.tensor import Shard, distribute_tensor

    tp2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("tp_a", "tp_b"))
    model = tiny()
    attn = model.model.layers[0].self_attn
    attn.q_proj.weight = torch.nn.Parameter(
        distribute_tensor(attn.q_proj.weight.detach(), tp2d, [Shard(0), Shard(1)]))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return _attempt(lambda: dmuon.dedicate_params(model, mesh, predicate=proj))


def _unnamed_tp(world):
    """tp-support.md "Requirements" 1: the Setup with TP on an unnamed 1-D mesh (the
    2 x 2 mesh's TP group, ``DeviceMesh.from_group`` without names)."""
    from torch.distributed.device_mesh import DeviceMesh

    grid = init_device_mesh("cpu", (2, world // 2))  # unnamed
    mesh = {"tp": DeviceMesh.from_group(grid.get_group(1), "cpu"),
            "dp": DeviceMesh.from_group(grid.get_group(0), "cpu", mesh_dim_names=("dp",))}
    model, opt = _attempt(lambda: _tp_setup(mesh))
    if isinstance(model, str):
        return (model, opt)
    return train(model, opt, mesh["dp"].get_local_rank(), 2)


def _tp_layouts(rank, world):
    out = {"tp_2d": _two_d_tp(world), "unnamed": _unnamed_tp(world)}
    tp1 = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    out["tp1"] = train(*_tp_setup(tp1), rank, world)
    out["dp_only"] = train(*_one_d(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))),
                           rank, world)
    R, G, T = 2, 1, 2  # 4 ranks: the replicate and TP axes, one shard rank per replica
    mesh3d = init_device_mesh("cpu", (R, G, T), mesh_dim_names=("replicate", "shard", "tp"))
    dp = mesh3d["replicate"].get_local_rank() * G + mesh3d["shard"].get_local_rank()
    out["3d"] = train(*_hsdp_tp(mesh3d), dp, R * G)
    return out


@functools.cache
def tp_layout_runs():
    return run(_tp_layouts, world_size=WORLD)


def test_tp_size_one_and_dp_only_match_the_reference():
    """guides/tp-support.md, "Requirements" 2: a ``(dp=N, tp=1)`` mesh and a ``(dp=N,)``
    mesh both train as one process does."""
    for res in tp_layout_runs():
        assert_close(res["dp_only"], reference())
        assert_close(res["tp1"], reference())


def test_tp_size_one_is_bit_identical_to_a_dp_only_mesh():
    """guides/tp-support.md, "Requirements" 2: "A ``(dp=N, tp=1)`` mesh behaves
    bit-identically to a ``(dp=N,)`` mesh" (torch's TP layers on a size-1 mesh give
    bit-identical gradients, so any difference is DMuon's)."""
    for res in tp_layout_runs():
        for key, value in res["dp_only"].items():
            assert torch.equal(res["tp1"][key], value), key


def test_hsdp_x_tp_matches_the_float64_reference():
    """guides/tp-support.md, "3D mesh: HSDP x TP", on (R, G, T) = (2, 1, 2)."""
    for res in tp_layout_runs():
        assert_close(res["3d"], reference())


def test_a_two_d_tp_axis_is_refused():
    """guides/tp-support.md, "Limitations": "1D TP only ... A multi-dim TP axis raises"."""
    for res in tp_layout_runs():
        assert res["tp_2d"][0] == "ValueError" and "1-D TP mesh" in res["tp_2d"][1], res["tp_2d"]


def test_tp_on_an_unnamed_mesh_trains_here():
    """guides/tp-support.md, "Requirements" 1 says an unnamed mesh under a DTensor
    raises ``ValueError`` (the reference finds the TP dim by name). Here the TP dim is the
    DTensor's own 1-D mesh, names unread: the Setup on an unnamed TP mesh trains as one
    process does, where the reference refuses it."""
    for res in tp_layout_runs():
        assert isinstance(res["unnamed"], dict), res["unnamed"]
        assert_close(res["unnamed"], reference())
