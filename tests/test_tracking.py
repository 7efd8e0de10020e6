"""TensorBoard output (service/train/tracking.py) from real step records: the training
loop a Ray worker runs, 4 gloo ranks without Ray, its records handed to the controller's
``TrackingCallback`` as Ray Train would (split across calls, ranks out of order, steps
reported again as after a restart), and the event file read back with a reader of its
own (tests/_tensorboard.py): every step's loss, per-rank loss, LR per group, gradient
norm, throughput, step time and validation loss."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
from _tensorboard import crc32c, event_files, scalars

from dmuon.testing import run
from service.spec import parse_spec
from service.train import tracking

STEPS = 4
SPEC = {"model": "tiny", "steps": STEPS, "batch_size": 2, "seq_len": 16,
        "clip_grad_norm": 1.0, "layout": {"replicate": 2, "shard": 2},
        "data": {"val_every": 2}, "schedule": {"warmup_steps": 2, "decay": "cosine"}}


def _job(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from service.train import loop

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    records = []
    loop.run_training(parse_spec(SPEC), mesh, report=lambda r, p: records.append(r))
    return records


@pytest.fixture(scope="module")
def records():
    """Every rank's records, through JSON as the spool keeps them."""
    per_rank = run(_job, world_size=4)
    return [json.loads(json.dumps(r)) for ranks in zip(*per_rank) for r in ranks]


def f32(x: float) -> float:
    return float(np.float32(x))


def _by_step(records) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for rec in records:
        out.setdefault(rec["step"], []).append(rec)
    return out


def test_every_steps_scalars_read_back_equal_the_records(records, tmp_path):
    by_step = _by_step(records)
    assert sorted(by_step) == [1, 2, 3, 4]
    assert all(sorted(r["rank"] for r in rs) == [0, 1, 2, 3] for rs in by_step.values())
    [callback] = tracking.callbacks(parse_spec(SPEC), str(tmp_path), world_size=4)
    callback = pickle.loads(pickle.dumps(callback))  # as Ray ships it to the controller
    assert not os.path.exists(tmp_path / "tensorboard")  # nothing opened before a report
    for step, ranks in by_step.items():
        # one step's ranks in two calls, out of order; step 1 again with other losses
        # (a restarted group's report) after step 2: the first complete set stays
        callback.after_report(None, [ranks[3], ranks[1]], None)
        assert step not in callback.aggregator.written
        callback.after_report(None, [ranks[2], ranks[0]], None)
        if step == 2:
            callback.after_report(None, [{**r, "loss": 99.0} for r in by_step[1]], None)
    assert callback.aggregator.sinks[0].closed  # closed on the final step
    [path] = event_files(str(tmp_path / "tensorboard"))
    got = scalars(str(tmp_path / "tensorboard"))
    steps = [1, 2, 3, 4]
    expect = {
        "loss": [np.mean([r["loss"] for r in by_step[s]]) for s in steps],
        **{f"loss/rank_{k}": [by_step[s][k]["loss"] for s in steps] for k in range(4)},
        **{f"lr/{g}": [by_step[s][0]["lr"][g] for s in steps] for g in ("muon", "adamw")},
        "grad_norm": [by_step[s][0]["grad_norm"] for s in steps],
        "tokens_per_s_total": [min(r["tokens_per_s_total"] for r in by_step[s])
                               for s in steps],
        "step_time_s": [max(r["step_time_s"] for r in by_step[s]) for s in steps],
    }
    for tag, values in expect.items():
        assert [s for s, _, _ in got[tag]] == steps, tag  # every step once, in order
        assert [v for _, v, _ in got[tag]] == [f32(v) for v in values], tag
    # the LR warms up and then decays: four different values per group, muon != adamw
    assert len({v for _, v, _ in got["lr/muon"]}) == 4
    assert got["lr/muon"][-1][1] != got["lr/adamw"][-1][1]
    assert [(s, v) for s, v, _ in got["val_loss"]] == [
        (s, f32(by_step[s][0]["val_loss"])) for s in (2, 4)]
    assert [t for _, _, t in got["loss"]] == [max(r["time"] for r in by_step[s])
                                              for s in steps]
    assert all(r["loss"] != 99.0 for r in records)
    assert os.path.getsize(path) > 0


def test_the_spec_switch_and_exports_write_no_event_files(tmp_path):
    off = parse_spec({**SPEC, "metrics": {"tensorboard": False}})
    assert tracking.callbacks(off, str(tmp_path), world_size=4) == []
    assert tracking.callbacks(parse_spec(SPEC), str(tmp_path), 4, export_only=True) == []
    assert parse_spec(SPEC).metrics.tensorboard is True


def test_the_readers_crc32c_matches_the_castagnoli_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
