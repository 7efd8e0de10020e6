"""The tracking sinks (service/driver/tracking_callback.py, sinks.py) from real step records: the
training loop a Ray worker runs, 4 gloo ranks without Ray, its records handed to the
controller's ``TrackingCallback`` as Ray Train would (split across calls, ranks out of
order, steps reported again as after a restart), to TensorBoard, MLflow (a SQLite
tracking store) and W&B (an offline run) at once, each read back with its own tools
(tests/helpers/tensorboard_events.py, tests/helpers/tracking.py): every step's loss,
per-rank loss, LR per group, gradient norm, throughput, step time and validation loss,
the same in all three.
A sink whose package is missing is refused at submission by the real service."""

from __future__ import annotations

import json
import math
import os
import pickle

import numpy as np
import pytest
from helpers.paths import DATA
from helpers.service_http import Service
from helpers.tensorboard_events import event_files, scalars
from helpers.tracking import mlflow_run, wandb_run

from dmuon.testing import run
from service.driver import tracking_callback as tracking
from service.job.spec import parse_spec

STEPS = 4
SPEC = {"model": "tiny", "steps": STEPS, "batch_size": 2, "seq_len": 16,
        "clip_grad_norm": 1.0, "layout": {"replicate": 2, "shard": 2},
        "data": {"val_every": 2}, "schedule": {"warmup_steps": 2, "decay": "cosine"}}


def _job(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.worker import loop

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    records = []
    loop.run_training(Job.local(SPEC, plan_on_one_host(SPEC)), mesh, lambda r, p: records.append(r))
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


def _mean(values) -> float:
    return math.fsum(values) / len(values)  # the correctly rounded sum, over the ranks


def _expected(by_step, steps) -> dict[str, list[float]]:
    return {
        "loss": [_mean([r["loss"] for r in by_step[s]]) for s in steps],
        **{f"loss/rank_{k}": [by_step[s][k]["loss"] for s in steps] for k in range(4)},
        **{f"lr/{g}": [by_step[s][0]["lr"][g] for s in steps] for g in ("muon", "adamw")},
        "grad_norm": [by_step[s][0]["grad_norm"] for s in steps],
        "tokens_per_s_total": [min(r["tokens_per_s_total"] for r in by_step[s])
                               for s in steps],
        "step_time_s": [max(r["step_time_s"] for r in by_step[s]) for s in steps],
    }


def _report_as_ray_train(callback, by_step) -> None:
    """One step's ranks in two calls, out of order; step 1 again with other losses (a
    restarted group's report) after step 2: the first complete set stays."""
    for step, ranks in by_step.items():
        callback.after_report(None, [ranks[3], ranks[1]])
        assert step not in callback.aggregator.written
        callback.after_report(None, [ranks[2], ranks[0]])
        if step == 2:
            callback.after_report(None, [{**r, "loss": 99.0} for r in by_step[1]])


def test_every_steps_scalars_read_back_equal_the_records_in_every_sink(records, tmp_path):
    import wandb

    by_step = _by_step(records)
    assert sorted(by_step) == [1, 2, 3, 4]
    assert all(sorted(r["rank"] for r in rs) == [0, 1, 2, 3] for rs in by_step.values())
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = parse_spec({**SPEC, "metrics": {"mlflow": {"tracking_uri": uri},
                                           "wandb": {"mode": "offline"}}})
    job_dir = tmp_path / "job-1"
    [callback] = tracking.callbacks(spec, str(job_dir), world_size=4)
    callback = pickle.loads(pickle.dumps(callback))  # as Ray ships it to the controller
    assert not os.path.exists(job_dir)  # nothing opened before a report
    _report_as_ray_train(callback, by_step)
    assert callback.aggregator.sinks[0].closed  # closed on the final step
    assert [s.name for s in callback.aggregator.sinks] == ["tensorboard", "mlflow", "wandb"]
    wandb.teardown()  # W&B's own process, started by this one
    [path] = event_files(str(job_dir / "tensorboard"))
    got = scalars(str(job_dir / "tensorboard"))
    steps = [1, 2, 3, 4]
    for tag, values in _expected(by_step, steps).items():
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
    run, in_mlflow = mlflow_run(uri, "job-1")
    records_wandb, in_wandb = wandb_run(str(job_dir))
    # MLflow and W&B keep float64: the records' own figures, exactly; the same tags as
    # TensorBoard, each its float32 rounding
    for tag, values in _expected(by_step, steps).items():
        assert in_mlflow[tag] == in_wandb[tag] == list(zip(steps, values)), tag
    assert set(in_mlflow) == set(in_wandb) == set(got)
    for tag, points in in_mlflow.items():
        assert [(s, f32(v)) for s, v in points] == [(s, v) for s, v, _ in got[tag]], tag
    assert run.info.status == "FINISHED" and run.info.run_name == "job-1"
    assert run.data.params["optimizer.lr"] == "0.02" and run.data.params["steps"] == "4"
    [started] = [r["run"] for r in records_wandb if r["type"] == "run"]
    assert started["display_name"] == "job-1" and started["project"] == "dmuon"
    assert [r["exit"]["exit_code"] for r in records_wandb if r["type"] == "exit"] == [0]


@pytest.mark.parametrize("ending,status,exit_code", [
    ("failed", "FAILED", 1), ("aborted", "KILLED", 130), ("exited", "KILLED", 130)])
def test_a_job_that_ends_before_its_last_step_ends_its_runs_so(records, tmp_path, ending,
                                                               status, exit_code):
    """Steps 1 and 2 of 4 reported, then Ray Train's controller finishes with an error
    (the workers failed past ``max_failures``), is aborted (a cancel, Ctrl-C), or exits
    without a word: the MLflow run ends FAILED or KILLED with an end time, the W&B run
    with an exit record, each read back with its own tool."""
    import types

    import wandb

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = parse_spec({**SPEC, "metrics": {"mlflow": {"tracking_uri": uri},
                                           "wandb": {"mode": "offline"}}})
    job_dir = tmp_path / "job-3"
    [callback] = tracking.callbacks(spec, str(job_dir), world_size=4)
    callback.after_report(None, [r for r in records if r["step"] <= 2])
    if ending == "failed":
        callback.after_controller_finish(types.SimpleNamespace(error=RuntimeError("rank 1")))
    elif ending == "aborted":
        callback.before_controller_abort()
    else:
        callback.aggregator.close()  # what the controller's atexit hook calls
    callback.after_controller_finish(types.SimpleNamespace(error=None))  # no second end
    wandb.teardown()
    run, history = mlflow_run(uri, "job-3")
    assert run.info.status == status and run.info.end_time >= run.info.start_time
    assert [s for s, _ in history["loss"]] == [1, 2]
    records_wandb, in_wandb = wandb_run(str(job_dir))
    assert [r["exit"]["exit_code"] for r in records_wandb if r["type"] == "exit"] == [
        exit_code]
    assert [s for s, _ in in_wandb["loss"]] == [1, 2]


def test_a_sink_that_cannot_open_is_reported_and_the_others_go_on(records, tmp_path,
                                                                   capfd):
    """MLflow's SQLite store under a regular file cannot be made: the job's log says so
    and TensorBoard still gets every step."""
    (tmp_path / "a-file").write_text("")
    uri = f"sqlite:///{tmp_path}/a-file/mlflow.db"
    spec = parse_spec({**SPEC, "metrics": {"mlflow": {"tracking_uri": uri}}})
    [callback] = tracking.callbacks(spec, str(tmp_path / "job-2"), world_size=4)
    callback.after_report(None, records)
    assert [s.name for s in callback.aggregator.sinks] == ["tensorboard"]
    assert "tracking: mlflow could not open (FileExistsError" in capfd.readouterr().err
    got = scalars(str(tmp_path / "job-2" / "tensorboard"))
    assert [s for s, _, _ in got["loss"]] == [1, 2, 3, 4]


def test_the_spec_switch_and_exports_write_no_event_files(tmp_path):
    off = parse_spec({**SPEC, "metrics": {"tensorboard": False}})
    assert tracking.callbacks(off, str(tmp_path), world_size=4) == []
    assert tracking.callbacks(parse_spec(SPEC), str(tmp_path), 4, export_only=True) == []
    assert parse_spec(SPEC).metrics.tensorboard is True


def test_a_sink_whose_package_is_missing_is_refused_at_submission(tmp_path):
    """The real service in an environment without ``wandb`` (tests/data/without_wandb):
    a job with W&B is refused with 422 naming ``spec.metrics.wandb``, nothing stored; one
    with MLflow (installed) is taken; an unknown sink is a 422 naming its field."""
    blocker = os.path.join(DATA, "without_wandb")
    path = os.pathsep.join(p for p in (blocker, os.environ.get("PYTHONPATH")) if p)
    svc = Service(str(tmp_path), DMUON_LOCAL_RAY="0", PYTHONPATH=path)
    try:
        spec = {"name": "tracked", "model": "tiny", "steps": 2}
        status, body = svc.request("POST", "/v1/jobs", {
            "spec": {**spec, "metrics": {"wandb": {"mode": "offline"}}}})
        assert status == 422, body
        [error] = body["detail"]
        assert error["field"] == "spec.metrics.wandb"
        assert "'wandb' package is not installed" in error["message"]
        assert "wandb==0.31.0" in error["message"]
        assert svc.request("GET", "/v1/jobs")[1] == []  # nothing stored
        status, body = svc.request("POST", "/v1/jobs", {"spec": {**spec, "metrics": {
            "neptune": {}}}})
        assert status == 422 and body["detail"][0]["field"] == "spec.metrics.neptune", body
        status, job = svc.request("POST", "/v1/jobs", {"spec": {**spec, "metrics": {
            "mlflow": {"tracking_uri": "http://127.0.0.1:5000"}}}})
        assert status == 201 and job["spec"]["metrics"]["mlflow"]["experiment"] is None, job
    finally:
        svc.kill()
