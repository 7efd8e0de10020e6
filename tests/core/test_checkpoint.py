"""Sharded DCP checkpoints: exact restart, resharding onto other layouts, and failures."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
from helpers.train import hsdp_train

from dmuon.testing import run

STEPS, SAVE_AT = 10, 5


def _train(layout, path=None, **kw):
    return run(hsdp_train, layout, steps=STEPS, path=path, world_size=layout[0] * layout[1],
               **kw)


@functools.cache
def saved_2x2(tmp):
    """Uninterrupted 2x2 run that saves at step 5 into ``tmp``."""
    return _train((2, 2), path=os.path.join(tmp, "ckpt"), save_at=SAVE_AT)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp"))


def _merged(results, key):
    merged = {}
    for res in results:
        merged.update(res[key])
    return merged


def test_restart_is_bit_identical_to_uninterrupted(ckpt_dir):
    full = saved_2x2(ckpt_dir)
    resumed = _train((2, 2), path=os.path.join(ckpt_dir, "ckpt"), load=True)
    for rank in range(4):
        assert resumed[rank]["losses"] == full[rank]["losses"][SAVE_AT:]
    a, b = _merged(full, "final"), _merged(resumed, "final")
    assert set(a) == set(b) and any(k.startswith("momentum/") for k in a)
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


@pytest.mark.parametrize("layout", [(1, 4), (4, 1), (1, 2)], ids=["1x4", "4x1", "1x2"])
def test_2x2_checkpoint_loads_on_other_layouts(ckpt_dir, layout):
    full = saved_2x2(ckpt_dir)
    resumed = _train(layout, path=os.path.join(ckpt_dir, "ckpt"), load=True)
    saved, loaded = _merged(full, "saved"), _merged(resumed, "loaded")
    assert set(saved) == set(loaded)
    for key, value in saved.items():  # params, momentum and AdamW state, exactly
        assert torch.equal(value, loaded[key]), key
    final, final_resumed = _merged(full, "final"), _merged(resumed, "final")
    for key, value in final.items():
        if key.endswith("/step"):
            assert torch.equal(value, final_resumed[key])
            continue
        err = ((final_resumed[key] - value).abs().max() / value.abs().max()).item()
        assert err <= 1e-9, (key, err)


def _load_only(rank, world, path):
    from helpers.train import build_dmuon
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model, opt = build_dmuon(mesh, True, config=os.environ.get("CKPT_TEST_MODEL", "tiny"))
    try:
        dmuon.checkpoint.load(path, model, opt)
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_bad_checkpoints_name_the_problem(ckpt_dir, tmp_path):
    saved_2x2(ckpt_dir)
    good = os.path.join(ckpt_dir, "ckpt")
    missing = run(_load_only, str(tmp_path / "nowhere"))
    assert all("FileNotFoundError" in m and "nowhere" in m for m in missing)

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    data = sorted(f for f in os.listdir(truncated) if f.endswith(".distcp"))[0]
    with open(truncated / data, "r+b") as fh:
        fh.truncate(100)
    for msg in run(_load_only, str(truncated)):
        assert data in msg and "truncated" in msg

    os.environ["CKPT_TEST_MODEL"] = "small"  # another model: other shapes, other keys
    try:
        other = run(_load_only, good)
    finally:
        del os.environ["CKPT_TEST_MODEL"]
    for msg in other:
        assert "does not fit this model" in msg
        assert "model/model.layers.3.self_attn.q_proj.weight" in msg or "missing" in msg
        assert "shape mismatches" in msg and "model/model.embed_tokens.weight" in msg


def _save_then_die(rank, world, path, snapshot_path, where):
    import torch.distributed.checkpoint as dcp
    from helpers.train import build_dmuon, global_batches, local_rows, loss_of
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model, opt = build_dmuon(mesh, True)
    for step, batch in enumerate(global_batches(2)):
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            dmuon.checkpoint.save(path, model, opt, extra={"step": 1})
            snap = dmuon.full_state_dict(model)
            if rank == 0:
                torch.save(snap, snapshot_path)
    writer = dcp.FileSystemWriter
    if where == "during_write":
        real = writer.write_data

        def write_then_die(self, plan, planner):
            real(self, plan, planner).wait()
            os._exit(9)
        writer.write_data = write_then_die
    else:  # all data written, killed before (or between) the renames that commit it
        renames = {"before_rename": 0, "between_renames": 1}[where]
        real_rename = os.rename

        def rename_then_die(*args):
            nonlocal renames
            if renames == 0:
                os._exit(9)
            renames -= 1
            real_rename(*args)
        dmuon.checkpoint.os.rename = rename_then_die
    dmuon.checkpoint.save(path, model, opt, extra={"step": 2})
    return "survived"


def _load_full(rank, world, path):
    from helpers.train import build_dmuon
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model, opt = build_dmuon(mesh, True)
    extra = dmuon.checkpoint.load(path, model, opt)
    return extra, dmuon.full_state_dict(model)


@pytest.mark.parametrize("where", ["during_write", "before_rename", "between_renames"])
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, where):
    path, snap_path = str(tmp_path / "ckpt"), str(tmp_path / "snap.pt")
    with pytest.raises(Exception, match="exit code 9"):
        run(_save_then_die, path, snap_path, where)
    assert os.path.isdir(path + ".partial")  # the interrupted save is left aside
    expected = torch.load(snap_path)
    for extra, full in run(_load_full, path):
        assert extra == {"step": 1}
        for key, value in expected.items():
            assert torch.equal(full[key], value), key
