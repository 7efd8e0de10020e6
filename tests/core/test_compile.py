"""torch.compile per block with DMuon, 4 gloo ranks, Z2, Z3 and HSDP 2x2, three forms:
``torch.compile(block)`` registered in place of the block before DMuon and FSDP2
(torchtitan's ``apply_compile`` order), ``block.compile()``, and ``torch.compile(block)``
after ``fully_shard`` (the reference implementation's order). Each trains 5 steps with
inductor and ends within 1e-9 (relative) of the same eager run; no graph breaks.

Float64, so the bound does not depend on this CPU's kernels: inductor fuses and reorders
float ops, which moves each result by a few ulps (about 1e-16 relative in float64); five
steps of Newton-Schulz and Adam amplify that by orders of magnitude, far less than 1e7.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.train import build_dmuon, global_batches, local_rows, loss_of

import dmuon
from dmuon.testing import run

STEPS = 5
LAYOUTS = {"z2": ((1, 4), False), "z3": ((1, 4), True), "hsdp2x2": ((2, 2), True)}
FORMS = ("wrap", "inplace", "wrap_after_fsdp")


def _compile_blocks(model, form):
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if form == "inplace":
            layer.compile()
        else:
            layers[i] = torch.compile(layer)
    return model


def _train(layout, z3, form, rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard"))
    before = form in ("wrap", "inplace")
    model, opt = build_dmuon(mesh["shard"], z3, replicate_mesh=mesh["replicate"],
                             fsdp_mesh=mesh,
                             prepare=functools.partial(_compile_blocks, form=form)
                             if before else None)
    if form == "wrap_after_fsdp":
        _compile_blocks(model, form)
    for batch in global_batches(STEPS):
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    return dmuon.full_state_dict(model)


def _all(rank, world):
    import torch._dynamo.utils as dynamo_utils  # the counters torch.compile keeps

    out = {}
    for name, (layout, z3) in LAYOUTS.items():
        out[name] = {"eager": _train(layout, z3, None, rank, world)}
        for form in FORMS:
            torch._dynamo.reset()  # each form compiles afresh (inductor's caches stay)
            dynamo_utils.counters.clear()
            out[name][form] = _train(layout, z3, form, rank, world)
            out[name][f"{form}/breaks"] = sum(dynamo_utils.counters["graph_break"].values())
            out[name][f"{form}/graphs"] = dynamo_utils.counters["stats"]["unique_graphs"]
    return out


@functools.cache
def _runs():
    return run(_all, world_size=4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_blocks_match_eager_with_no_graph_break(name):
    for rank, runs in enumerate(_runs()):
        res = runs[name]
        for form in FORMS:
            print(f"{name} {form} rank {rank}: {res[f'{form}/breaks']} graph breaks, "
                  f"{res[f'{form}/graphs']} graphs compiled")
            assert res[f"{form}/breaks"] == 0 and res[f"{form}/graphs"] >= 1, (name, form)
            for key, value in res["eager"].items():
                err = ((res[form][key] - value).abs().max() / value.abs().max()).item()
                assert err <= 1e-9, (name, form, rank, key, err)



def _cuda_graphs_under_z3(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    refusals = {}
    for mode in ("reduce-overhead", "max-autotune"):
        for form in ("inplace", "wrap"):
            def prepare(model, mode=mode, form=form):
                for i, layer in enumerate(model.model.layers):
                    if form == "inplace":
                        layer.compile(mode=mode)
                    else:
                        model.model.layers[i] = torch.compile(layer, mode=mode)
                return model

            model, _ = build_dmuon(mesh, True, prepare=prepare)
            try:  # the check runs before the first forward's collectives, on every rank
                model(global_batches(1)[0][:1, :-1])
            except ValueError as e:
                refusals[mode, form] = str(e)
    # Z2 keeps its packed storage: the same set-up check passes (the forward itself
    # would compile with inductor for a minute here, and run no CUDA graph on the CPU)
    model, _ = build_dmuon(mesh, False, prepare=lambda m: (m.model.layers[0].compile(
        mode="reduce-overhead"), m)[1])
    dmuon.get_state(model).before_first_forward()
    return refusals


def test_cuda_graph_modes_are_refused_under_z3_by_name():
    """Refused at the first forward, before anything is compiled or sent."""
    for refusals in run(_cuda_graphs_under_z3, world_size=2):
        assert len(refusals) == 4, refusals.keys()
        for msg in refusals.values():
            assert "model.layers.0" in msg and "CUDA graphs" in msg
            assert "reshard_after_forward=False" in msg


def _compiled_around_the_boundaries(rank, world):
    """``reduce-overhead`` applied after ``dedicate_params`` and ``fully_shard``: around
    each block (the boundary's parent now) and around the whole model (on no module of
    its tree: the wrapper is found on the call stack)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    refusals = {}
    for form in ("block", "root"):
        model, _ = build_dmuon(mesh, True)
        if form == "block":
            for i, layer in enumerate(model.model.layers):
                model.model.layers[i] = torch.compile(layer, mode="reduce-overhead")
            call = model
        else:
            call = torch.compile(model, mode="reduce-overhead")
        try:
            call(global_batches(1)[0][:1, :-1])
        except ValueError as e:
            refusals[form] = str(e)
    return refusals


def test_cuda_graphs_compiled_after_dedicate_params_are_refused_under_z3():
    for refusals in run(_compiled_around_the_boundaries, world_size=2):
        assert set(refusals) == {"block", "root"}, refusals
        assert "model.layers.0" in refusals["block"]
        for msg in refusals.values():
            assert "CUDA graphs" in msg and "reshard_after_forward=False" in msg


def _gather_while_capturing(rank, world):
    """The capture check's test double: every stream reads as capturing after a first
    eager step (warm-up), as under ``torch.cuda.graph`` around a later training step."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon.cuda_graphs

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    errors = {}
    for z3 in (True, False):
        model, _ = build_dmuon(mesh, z3)
        batch = global_batches(1)[0][:1, :-1]
        model(batch).sum().backward()
        real, dmuon.cuda_graphs._capturing = dmuon.cuda_graphs._capturing, lambda device: True
        try:
            model(batch).sum().backward()
        except RuntimeError as e:
            errors[z3] = str(e)
        finally:
            dmuon.cuda_graphs._capturing = real
    return errors


def test_a_z3_gather_during_a_cuda_graph_capture_is_refused():
    """Z3 reallocates on the first gather of the step and is refused there, naming the
    boundary, the reason and the fix; Z2's storage never moves, so it runs."""
    for errors in run(_gather_while_capturing, world_size=2):
        assert set(errors) == {True}, errors
        msg = errors[True]
        assert "model.layers.0" in msg and "CUDA graph is being captured" in msg
        assert "reshard_after_forward=False" in msg
