"""``checkpoint.resume_from``: a job continues from another job's checkpoint (weights,
optimizer state, step) on another layout, its LR schedule and data order going on from
that step. The training loop a Ray worker runs, on 4 gloo ranks without Ray: job A on
1x4 checkpoints steps 4 and 6; job B resumes from A's step 4 (a path) on 2x2, job D from
job A by its id (its newest, step 6), and both end within 1e-9 (relative, per tensor:
the bound of tests/core/test_checkpoint.py's resharded loads, README "Correctness") of an
uninterrupted 10-step 2x2 run. In float64 the layouts change only the order of the
reductions; both layouts give every rank the same rows of the global batch. B restarted
from its own step-8 checkpoint ends ``torch.equal`` to B. Bad values are refused, naming
the field, by ``service.job.inputs`` (the API's check and the entrypoint's: both shown)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dmuon.testing import run
from service.job.inputs import MANIFEST, resolve_inputs
from service.job.spec import SpecError, parse_spec

A_ID = "dmuon-00000000000a"
BASE = {"model": "tiny", "batch_size": 2, "seq_len": 32, "precision": "float64",
        "data": {"val_every": 0}, "export": {"enabled": False},
        # steps 1-6 warm up whatever `steps` is: A (6 steps) and the 10-step runs agree
        "schedule": {"warmup_steps": 6, "decay": "cosine", "min_lr_ratio": 0.1}}
A = {**BASE, "steps": 6, "layout": {"replicate": 1, "shard": 4},
     "checkpoint": {"interval": 4, "keep_last": 0}}
C = {**BASE, "steps": 10, "layout": {"replicate": 2, "shard": 2}}
B = {**C, "checkpoint": {"interval": 4, "keep_last": 0,
                         "resume_from": f"{A_ID}/dcp/step_000004"}}
D = {**C, "checkpoint": {"resume_from": A_ID}}


def _job(storage, spec_data, job_id):
    """(records as (step, resumed_from, loss), full params on rank 0) of one job."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.worker.loop import run_training

    spec = parse_spec(spec_data)
    inputs = resolve_inputs(spec, os.path.join(storage, "data"), storage)
    mesh = init_device_mesh("cpu", (spec.layout.replicate, spec.layout.shard),
                            mesh_dim_names=("replicate", "shard"))
    records = []
    job = Job.local(spec, plan_on_one_host(spec), inputs=inputs,
                    checkpoint_dir=os.path.join(storage, job_id, "dcp"))
    model = run_training(job, mesh, lambda r, p: records.append(r))
    params = dmuon.full_state_dict(model)
    return ([(r["step"], r["resumed_from"], r["loss"]) for r in records],
            params if dist.get_rank() == 0 else None)


def _jobs(rank, world, storage):
    import torch.distributed as dist

    out = {"A": _job(storage, A, A_ID), "C": _job(storage, C, "uninterrupted")}
    # B's path is relative to the data root here: the storage root's data/ (a link to it)
    out["B"] = _job(storage, B, "resumed")
    if rank == 0:  # B fails after its step-8 checkpoint: the restart resumes from its own
        shutil.rmtree(os.path.join(storage, "resumed", "dcp", "step_000010"))
    dist.barrier()
    out["B again"] = _job(storage, B, "resumed")
    out["D"] = _job(storage, D, "by-id")
    return out


def _close(got: dict, want: dict, bound: float = 1e-9) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        err = ((got[key] - value).abs().max() / value.abs().max()).item()
        assert err <= bound, (key, err)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    storage = tmp_path_factory.mktemp("runs")
    # relative resume_from paths are read under the data root: link A's job there
    os.makedirs(storage / "data")
    os.symlink(storage / A_ID, storage / "data" / A_ID)
    os.makedirs(storage / A_ID)
    return run(_jobs, str(storage), world_size=4), str(storage)


def test_resumed_on_another_layout_equals_an_uninterrupted_run(jobs):
    ranks, _ = jobs
    for out in ranks:
        steps = {k: [(s, f) for s, f, _ in out[k][0]] for k in out}
        assert steps["A"] == [(s, 0) for s in range(1, 7)]
        assert steps["B"] == [(s, 4) for s in range(5, 11)]  # numbered on from step 4
        assert steps["B again"] == [(9, 8), (10, 8)]  # its own step 8, not A's step 4
        assert steps["D"] == [(s, 6) for s in range(7, 11)]  # the job's newest: step 6
        want = {s: loss for s, _, loss in out["C"][0]}
        for key in ("B", "D"):
            for s, _, loss in out[key][0]:
                assert abs(loss - want[s]) <= 1e-9 * abs(want[s]), (key, s)
    params = ranks[0]
    _close(params["B"][1], params["C"][1])
    _close(params["D"][1], params["C"][1])
    for key, value in params["B"][1].items():
        assert torch.equal(params["B again"][1][key], value), key
    # the run moved well beyond the bound from where B started
    assert max((params["C"][1][k] - params["A"][1][k]).abs().max().item()
               for k in params["C"][1]) > 1e-3


def test_each_job_writes_its_own_checkpoints(jobs):
    _, storage = jobs
    assert sorted(os.listdir(os.path.join(storage, A_ID, "dcp"))) == ["step_000004",
                                                                      "step_000006"]
    assert sorted(os.listdir(os.path.join(storage, "resumed", "dcp"))) == ["step_000008",
                                                                           "step_000010"]
    assert not os.path.exists(os.path.join(storage, "by-id", "dcp"))  # interval 0


def _fake_checkpoint(path) -> None:
    os.makedirs(path)
    with open(os.path.join(path, MANIFEST), "w") as fh:
        fh.write('{"files": {}}')


@pytest.fixture
def roots(tmp_path):
    storage, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    _fake_checkpoint(storage / "job-a" / "dcp" / "step_999999")
    _fake_checkpoint(storage / "job-a" / "dcp" / "step_1000000")  # newer: by number
    os.makedirs(storage / "job-b" / "dcp" / "step_000002")  # no manifest: not committed
    os.makedirs(storage / "job-b" / "dcp" / "step_000004.partial")
    os.makedirs(storage / "data" / "empty")
    _fake_checkpoint(elsewhere / "step_000004")
    return str(storage), str(elsewhere)


def _resolve(roots, value, steps=2_000_000):
    storage, _ = roots
    spec = parse_spec({"model": "tiny", "steps": steps, "checkpoint": {"resume_from": value}})
    return resolve_inputs(spec, os.path.join(storage, "data"), storage)["resume_from"]


def test_job_ids_and_paths_resolve_to_the_newest_committed_checkpoint(roots):
    storage, _ = roots
    newest = os.path.join(storage, "job-a", "dcp", "step_1000000")
    assert os.path.realpath(_resolve(roots, "job-a")) == os.path.realpath(newest)
    for value in (f"{storage}/job-a", f"{storage}/job-a/dcp", newest,
                  f"{storage}/job-a/dcp/step_1000000/"):
        assert os.path.realpath(_resolve(roots, value)) == os.path.realpath(newest)
    older = os.path.join(storage, "job-a", "dcp", "step_999999")
    assert os.path.realpath(_resolve(roots, older)) == os.path.realpath(older)
    assert resolve_inputs(parse_spec({"model": "tiny"}), storage, storage)["resume_from"] \
        is None


@pytest.mark.parametrize("value,says", [
    ("dmuon-000000000404", "no job 'dmuon-000000000404'"),
    ("job-b", "holds no committed checkpoint"),
    ("{storage}/job-b/dcp", "holds no committed checkpoint"),
    ("empty/", "holds no committed checkpoint"),
    ("missing/dir", "no directory"),
    ("{elsewhere}/step_000004", "outside the data root and the storage root"),
    ("{storage}/../elsewhere/step_000004", "a path without '..'"),
    ("not an id", "a job id"),
])
def test_bad_resume_from_is_refused_naming_the_field(roots, value, says):
    storage, elsewhere = roots
    with pytest.raises(SpecError, match="checkpoint.resume_from") as e:
        _resolve(roots, value.format(storage=storage, elsewhere=elsewhere))
    assert says in str(e.value)


def test_a_checkpoint_at_or_past_the_last_step_is_refused(roots):
    with pytest.raises(SpecError, match="checkpoint.resume_from: 'job-a' is at step "
                                        "1000000, steps is 1000000: nothing left"):
        _resolve(roots, "job-a", steps=1_000_000)


def test_entrypoint_exits_2_and_the_api_answers_422_naming_the_field(roots, tmp_path,
                                                                    capsys):
    from helpers.service_http import Service

    from service.driver.job_driver import main

    storage, _ = roots
    spec = tmp_path / "job.yaml"
    spec.write_text("model: tiny\nsteps: 5\ncheckpoint: {resume_from: job-b}\n")
    assert main(["--spec", str(spec), "--storage", storage]) == 2
    assert "checkpoint.resume_from: 'job-b' holds no committed checkpoint" in \
        capsys.readouterr().err
    os.makedirs(tmp_path / "svc")
    svc = Service(str(tmp_path / "svc"), DMUON_LOCAL_RAY="0", DMUON_STORAGE=storage)
    try:
        tiny = {"model": "tiny", "steps": 5, "layout": {"replicate": 2, "shard": 2}}
        status, body = svc.request("POST", "/v1/jobs", {"spec": {
            **tiny, "checkpoint": {"resume_from": "dmuon-000000000404"}}})
        assert status == 422, body
        assert [d["field"] for d in body["detail"]] == ["spec.checkpoint.resume_from"]
        _fake_checkpoint(os.path.join(storage, "job-c", "dcp", "step_000002"))
        status, job = svc.request("POST", "/v1/jobs", {"spec": {
            **tiny, "checkpoint": {"resume_from": "job-c"}}})
        assert status == 201, job
        svc.request("POST", f"/v1/jobs/{job['id']}/cancel")
    finally:
        svc.kill()
