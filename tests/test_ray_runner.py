"""The Ray Train runner on real Ray: a local head on 127.0.0.1 (our own process group) and
a simulated 2-node cluster; TorchTrainer, fault recovery and ``ray job submit``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from service.local_ray import RAY, LocalRayHead
from service.spec import parse_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = {"name": "t", "model": "tiny", "steps": 8, "batch_size": 4, "seq_len": 32,
        "layout": {"replicate": 2, "shard": 2}, "checkpoint": {"interval": 4},
        "data": {"val_every": 4}, "max_failures": 1}


@pytest.fixture(scope="module")
def head():
    import ray

    head = LocalRayHead.start(num_cpus=4)
    try:
        ray.init(address=head.address, log_to_driver=False)
        yield head
    finally:
        ray.shutdown()
        head.stop()


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


def _records(storage, job_id):
    with open(os.path.join(storage, job_id, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _run(storage, job_id, **kw):
    from service.entrypoint import run_job

    params = os.path.join(storage, f"{job_id}.params.pt")
    run_job(parse_spec(SPEC), job_id=job_id, storage=storage, return_params=params, **kw)
    return _records(storage, job_id), torch.load(params)


@pytest.fixture(scope="module")
def baseline(head, storage):
    return _run(storage, "baseline")


def test_trainer_learns_and_reports_every_rank(baseline):
    records, _ = baseline
    steps = sorted({r["step"] for r in records})
    assert steps == list(range(1, 9))
    for step in steps:
        assert sorted(r["rank"] for r in records if r["step"] == step) == [0, 1, 2, 3]
    val = [r["val_loss"] for r in records if r["step"] == 8]
    assert val and val[0] <= math.log(256) - 1.0, val
    coords = {r["rank"]: tuple(r["coord"]) for r in records}
    assert coords == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}


def test_worker_killed_at_step_6_resumes_from_step_4(baseline, storage):
    marker = os.path.join(storage, "fault-fired")
    records, params = _run(storage, "faulty", fault=f"1:6:{marker}")
    assert os.path.exists(marker)
    first = [r["step"] for r in records if r["rank"] == 0 and r["resumed_from"] == 0]
    second = [r["step"] for r in records if r["rank"] == 0 and r["resumed_from"] > 0]
    # the first attempt reported from step 1 (reports still in flight when a worker dies
    # are lost); the restarted group resumed from the checkpoint of step 4
    assert first == list(range(1, len(first) + 1)) and len(first) <= 5
    assert {r["resumed_from"] for r in records if r["resumed_from"] > 0} == {4}
    assert second == [5, 6, 7, 8]
    for key, value in baseline[1].items():
        assert torch.equal(params[key], value), key


def test_ray_job_submit_succeeds_with_json_lines(head, storage, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({**SPEC, "steps": 3, "checkpoint": {"interval": 0}}))
    env = {**os.environ, "RAY_ADDRESS": head.dashboard}
    runtime_env = {"excludes": [".venv", ".git", "*.pt", "bench/results"]}
    proc = subprocess.run(
        [RAY, "job", "submit", "--working-dir", ROOT,
         "--runtime-env-json", json.dumps(runtime_env), "--",
         sys.executable, "-m", "service.entrypoint", "--spec", str(spec),
         "--storage", storage, "--job-id", "submitted"],
        env=env, capture_output=True, text=True, timeout=300)
    assert "SUCCEEDED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the job's stdout, as `ray job submit` relays it (lines may carry a log prefix)
    lines = [json.loads(line[line.index('{"'):]) for line in proc.stdout.splitlines()
             if '{"step": ' in line or '{"summary": ' in line]
    steps = [line["step"] for line in lines if "step" in line]
    assert steps == [1, 2, 3], proc.stdout[-2000:]
    assert all(len(line["ranks"]) == 4 for line in lines if "step" in line)
    assert lines[-1]["summary"]["status"] == "SUCCEEDED"


def test_second_local_head_on_the_same_machine_takes_jobs(head):
    """Two service-managed heads side by side (two services, or a head left over from an
    earlier one): each must have its own job agent, not a port the other holds."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    second = LocalRayHead.start(num_cpus=1)
    try:
        client = JobSubmissionClient(second.dashboard)
        job = client.submit_job(entrypoint=f"{sys.executable} -c 'print(6 * 7)'")
        deadline = time.time() + 120
        while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED,
                                                 JobStatus.STOPPED):
            assert time.time() < deadline, "the second head's job never finished"
            time.sleep(0.5)
        assert client.get_job_status(job) == JobStatus.SUCCEEDED
        assert "42" in client.get_job_logs(job)
    finally:
        second.stop()


def test_service_plans_on_the_attached_clusters_nodes(head, tmp_path):
    """The control plane attached to a running cluster plans on its nodes (1 x 4 CPUs
    here), as the job's entrypoint will, not on the nodes it assumes without one."""
    from _http import Service

    svc = Service(str(tmp_path), RAY_ADDRESS=head.dashboard, DMUON_LOCAL_CPUS="64")
    try:
        _, plan = svc.request("POST", "/v1/plan", {**SPEC, "layout": {}})
        assert plan["inventory"] == {"source": "cluster", "nodes": 1}
        assert (plan["layout"]["replicate"], plan["layout"]["shard"]) == (1, 4)
        assert len(plan["ranks"]) == 4
        # 8 workers do not fit the cluster now: planned on the assumed 64-CPU node instead,
        # with the reason (a cluster may grow before the job starts)
        _, plan = svc.request("POST", "/v1/plan", {**SPEC, "layout": {"workers_per_node": 8}})
        inventory = plan["inventory"]
        assert (inventory["source"], inventory["cpus_per_node"]) == ("assumed", 64)
        assert "workers_per_node=8" in inventory["reason"] and len(plan["ranks"]) == 8
    finally:
        svc.kill()


def test_two_simulated_nodes_replicate_across_shard_within(baseline, storage):
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # leave the head for a 2-node cluster of our own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, log_to_driver=False)
        from service.entrypoint import run_job

        spec = parse_spec({**SPEC, "layout": {}})  # auto: 2 nodes x 2 workers
        params_path = os.path.join(storage, "two_nodes.params.pt")
        _, placement, _ = run_job(spec, job_id="two_nodes", storage=storage,
                                  return_params=params_path)
        assert (placement.replicate, placement.shard) == (2, 2)
        records = _records(storage, "two_nodes")
        node = {r["rank"]: r["node_id"] for r in records}
        coord = {r["rank"]: tuple(r["coord"]) for r in records}
        by_row = {}
        for rank, (r, _) in coord.items():
            by_row.setdefault(r, set()).add(node[rank])
        assert all(len(nodes) == 1 for nodes in by_row.values())  # shard within a node
        assert by_row[0] != by_row[1]  # replicate across nodes
        params = torch.load(params_path)
        for key, value in baseline[1].items():
            assert torch.equal(params[key], value), key
    finally:
        ray.shutdown()
        cluster.shutdown()
