"""End to end: real uvicorn on 127.0.0.1, a local Ray head, jobs through Ray's job API."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from _http import Service
from _ray import RayHead

SPEC = {"name": "e2e", "model": "tiny", "steps": 6, "batch_size": 2, "seq_len": 32,
        "layout": {"replicate": 2, "shard": 2}, "data": {"val_every": 0}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    head = RayHead(num_cpus=4)
    try:
        svc = Service(str(tmp_path_factory.mktemp("e2e")), RAY_ADDRESS=head.dashboard,
                      DMUON_MAX_RUNNING="1")
        try:
            yield svc
        finally:
            svc.kill()
    finally:
        head.stop()


def _wait_status(svc, job_id, wanted, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = svc.request("GET", f"/v1/jobs/{job_id}")[1]["status"]
        if status in wanted:
            return status
        time.sleep(0.5)
    raise TimeoutError(f"{job_id} still {status}")


def test_submit_follow_events_to_success_and_cancel_another(stack):
    svc = stack
    status, job = svc.request("POST", "/v1/jobs", {"spec": SPEC})
    assert status == 201 and job["status"] == "PENDING"
    # max_running=1: the second job waits in the service's queue, then is cancelled
    _, queued = svc.request("POST", "/v1/jobs", {"spec": {**SPEC, "steps": 50}})
    events = []
    with urllib.request.urlopen(f"{svc.url}/v1/jobs/{job['id']}/events", timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    statuses = [e["status"] for e in events if "status" in e]
    assert statuses[-1] == "SUCCEEDED", svc.request("GET", f"/v1/jobs/{job['id']}/logs")[1]
    steps = sorted({e["step"] for e in events if "step" in e})
    assert steps == list(range(1, 7))
    metrics = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert len(metrics) == 6 * 4  # every step, every rank
    assert svc.request("GET", f"/v1/jobs/{job['id']}/partition")[0] == 200
    _wait_status(svc, queued["id"], {"RUNNING"})
    assert svc.request("POST", f"/v1/jobs/{queued['id']}/cancel")[1]["status"] == "STOPPED"
    status, logs = svc.request("GET", f"/v1/jobs/{job['id']}/logs")
    assert status == 200 and '"summary"' in logs
    assert svc.request("GET", f"/v1/jobs/{job['id']}/logs", token=False)[0] == 401


def test_sigkill_restart_keeps_jobs_and_metrics_and_reconciles(stack):
    svc = stack
    _, job = svc.request("POST", "/v1/jobs", {"spec": {**SPEC, "steps": 30}})
    deadline = time.time() + 240
    while time.time() < deadline and len(svc.request(
            "GET", f"/v1/jobs/{job['id']}/metrics")[1]) < 4 * 3:
        time.sleep(0.3)
    before = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert len(before) >= 12
    svc.kill()  # SIGKILL while the job runs; its posts fail meanwhile, its spool goes on
    time.sleep(3)
    svc.start()
    assert svc.request("GET", f"/v1/jobs/{job['id']}")[1]["status"] in ("RUNNING",
                                                                       "SUCCEEDED")
    assert _wait_status(svc, job["id"], {"SUCCEEDED"}) == "SUCCEEDED"
    after = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    keys = [(m["step"], m["rank"]) for m in after]
    assert keys == [(s, r) for s in range(1, 31) for r in range(4)]  # none lost, no dups
    assert all(m in after for m in before)
