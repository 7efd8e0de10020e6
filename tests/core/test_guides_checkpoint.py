"""The reference's guide "Checkpointing" (/work/shared/reference/docs/guides/checkpoint.md):
its calls on 4 gloo ranks in float64, checked against a float64 single-process
torch.optim.Muon + AdamW run, the files a single process reads back, or an uninterrupted
run. One distributed run holds every set-up.

Usages tested elsewhere with the same calls (guide section: test):

- "HSDP async drain is automatic" (`get_model_state_dict` right after an async HSDP
  step): test_guides_quickstart.py::test_quickstart_matches_one_process[hsdp2x2]
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
from helpers.guides import assert_matches, global_loss, one_process, tiny, torch_optimizers
from helpers.model import build_model, get_config
from helpers.train import global_batches, local_rows, loss_of
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

WORLD, TOTAL, SAVE_INTERVAL = 4, 4, 2
BATCHES = global_batches(TOTAL + 1)  # the last one: the step after a topology change


# -- checkpoint.md "Full Example", as written but for gloo, float64 and the test model --

def setup_model(mesh):
    """Build and wrap model (on a 2-D mesh: training.md "Scaling Out"'s HSDP set-up)."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)  # MyModel()
    predicate = lambda n, p: "proj" in n and p.ndim == 2  # noqa: E731
    if mesh.ndim == 1:
        dmuon.dedicate_params(model, mesh, predicate=predicate)
    else:
        dmuon.dedicate_params(model, mesh["shard"], predicate=predicate,
                              replicate_mesh=mesh["replicate"])
    fsdp_mesh = mesh
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    return model, optimizer


def save_checkpoint(model, optimizer, step, path="checkpoint.pt"):
    model_sd = dmuon.get_model_state_dict(model)
    optim_sd = dmuon.get_optimizer_state_dict(model, optimizer)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "step": step}, path)
    dist.barrier()


def load_checkpoint(model, optimizer, path="checkpoint.pt"):
    ckpt = torch.load(path, map_location="cpu")
    dmuon.set_model_state_dict(model, ckpt["model"])
    dmuon.set_optimizer_state_dict(model, optimizer, ckpt["optim"])
    return ckpt.get("step", 0)


def _main(rank, world, mesh, path, total_steps):
    """The guide's "--- Main ---": resume if the checkpoint exists, train to
    ``total_steps``, save every ``SAVE_INTERVAL`` steps."""
    model, optimizer = setup_model(mesh)
    start_step = 0
    if os.path.exists(path):
        start_step = load_checkpoint(model, optimizer, path)
    for step in range(start_step, total_steps):
        optimizer.zero_grad()
        loss = loss_of(model, local_rows(BATCHES[step], rank, world))  # model(batch).loss
        loss.backward()
        optimizer.step()
        if (step + 1) % SAVE_INTERVAL == 0:
            save_checkpoint(model, optimizer, step + 1, path)
    return model, {"start": start_step, "full": dmuon.full_state_dict(model)}


def _pretrained(rank, world, mesh, root) -> dict:
    """"Load Pretrained (No Optimizer State)": a single-process `torch.save(
    model.state_dict())` file and a safetensors one (HF's format); then one step."""
    from safetensors.torch import load_file

    out = {}
    for name, load in {"pt": lambda p: torch.load(p, map_location="cpu"),
                       "safetensors": load_file}.items():
        model, optimizer = setup_model(mesh)
        pretrained_sd = load(os.path.join(root, f"pretrained_model.{name}"))
        dmuon.set_model_state_dict(model, pretrained_sd)
        out[name] = dmuon.get_model_state_dict(model)
    loss_of(model, local_rows(BATCHES[0], rank, world)).backward()
    optimizer.step()
    out["stepped"] = dmuon.full_state_dict(model)
    return out


def _cross_topology(rank, world, model, root) -> dict:
    """"Cross-Topology Restore": the weights saved with cpu_offload=True on the 1-D
    layout, loaded on a 2 x 2 HSDP one with fresh optimizer state; one step."""
    sd = dmuon.get_model_state_dict(model, cpu_offload=True)
    path = os.path.join(root, "topology.pt")
    if dist.get_rank() == 0:
        torch.save(sd, path)
    dist.barrier()
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    new_model, optimizer = setup_model(hsdp)
    dmuon.set_model_state_dict(new_model, torch.load(path, map_location="cpu"))
    out = {"loaded": dmuon.full_state_dict(new_model)}
    loss_of(new_model, local_rows(BATCHES[TOTAL], rank, world)).backward()
    optimizer.step()
    out["stepped"] = dmuon.full_state_dict(new_model)
    return out


def _checkpoints(rank, world, root) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    path = os.path.join(root, "checkpoint.pt")
    out = {"killed": _main(rank, world, mesh, path, SAVE_INTERVAL)[1]}  # stops at step 2
    model, out["resumed"] = _main(rank, world, mesh, path, TOTAL)
    out["whole"] = _main(rank, world, mesh, os.path.join(root, "whole.pt"), TOTAL)[1]
    out["pretrained"] = _pretrained(rank, world, mesh, root)
    out["topology"] = _cross_topology(rank, world, model, root)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The run and its directory: single-process pretrained files written first."""
    from safetensors.torch import save_file

    root = str(tmp_path_factory.mktemp("guides-checkpoint"))
    pretrained = build_model(get_config("tiny"), dtype=torch.float64, seed=1).state_dict()
    torch.save(pretrained, os.path.join(root, "pretrained_model.pt"))
    save_file(pretrained, os.path.join(root, "pretrained_model.safetensors"))
    return root, run(_checkpoints, root, world_size=WORLD)


@functools.cache
def _reference():
    """TOTAL steps in one process: final weights, and the optimizers' state by FQN."""
    model = tiny()
    opts = torch_optimizers(model, lr=0.02, adamw_lr=1e-3)
    final, _ = one_process(model, opts, global_loss(BATCHES), TOTAL)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: dict(s) for o in opts for p, s in o.state.items()}
    return final, state


def _one_step_from(sd, batch):
    model = tiny()
    model.load_state_dict(sd)
    opts = torch_optimizers(model, lr=0.02, adamw_lr=1e-3)
    return one_process(model, opts, global_loss([batch]), 1)[0]


def test_full_example_resumes_as_if_uninterrupted(runs):
    """checkpoint.md "Full Example" ("Save", "Load (Resume Training)"): a run saved at
    step 2, a new model resumed from the file to step 4, equal bit for bit to an
    uninterrupted run and to one process within 1e-9."""
    ref, _ = _reference()
    for res in runs[1]:
        assert (res["killed"]["start"], res["resumed"]["start"], res["whole"]["start"]) == \
            (0, SAVE_INTERVAL, 0)
        for key, value in res["whole"]["full"].items():
            assert torch.equal(res["resumed"]["full"][key], value), key
        assert_matches(res["resumed"]["full"], ref)


def test_state_dict_format(runs):
    """checkpoint.md "State Dict Format" and "Save": rank 0's file holds the standard flat
    model state dict (a single process's keys) and the optimizer state by FQN in
    torch's layout (docs/migration.md: not the reference's fsdp2/dedicated sections):
    torch.optim.Muon's momentum and AdamW's moments and step counters."""
    ref, state = _reference()
    root, _ = runs
    ckpt = torch.load(os.path.join(root, "checkpoint.pt"), map_location="cpu")
    assert ckpt["step"] == TOTAL
    assert list(ckpt["model"]) == list(tiny().state_dict())
    assert_matches(ckpt["model"], ref)
    assert set(ckpt["optim"]) == {"state", "param_groups"}
    assert set(ckpt["optim"]["state"]) == set(state)
    for fqn, moments in state.items():
        saved = ckpt["optim"]["state"][fqn]
        assert set(saved) == set(moments), fqn
        assert_matches({k: torch.as_tensor(v) for k, v in saved.items()},
                       {k: torch.as_tensor(v) for k, v in moments.items()})


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_load_pretrained(fmt, runs):
    """checkpoint.md "Load Pretrained (No Optimizer State)": a single-process
    `torch.save(model.state_dict())` file, or safetensors, loads bitwise; one step
    from it matches one process."""
    pretrained = build_model(get_config("tiny"), dtype=torch.float64, seed=1).state_dict()
    results = runs[1]
    loaded = results[0]["pretrained"][fmt]
    assert list(loaded) == list(pretrained)
    assert all(torch.equal(loaded[k], v) for k, v in pretrained.items())
    ref = _one_step_from(pretrained, BATCHES[0])
    for res in results:
        assert_matches(res["pretrained"]["stepped"], ref)


def test_cross_topology_restore(runs):
    """checkpoint.md "Cross-Topology Restore": weights saved on 4 x 1 with
    cpu_offload=True, read back by one process (torch.load here), loaded on a 2 x 2
    HSDP layout bitwise; a step from them with fresh optimizer state matches one
    process."""
    ref, _ = _reference()
    root, results = runs
    saved = torch.load(os.path.join(root, "topology.pt"), map_location="cpu")
    assert_matches(saved, ref)
    expected = _one_step_from(saved, BATCHES[TOTAL])
    for res in results:
        assert all(torch.equal(res["topology"]["loaded"][k], v) for k, v in saved.items())
        assert_matches(res["topology"]["stepped"], expected)
