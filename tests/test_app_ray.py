"""End to end: real uvicorn on 127.0.0.1 starting its own local Ray head, jobs through
Ray's job API, the dashboard in Debian's Chromium, and a SIGKILLed service restarting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from _browser import ARTIFACTS, page_with_errors
from _http import Service

from service.cluster import STATE_FILE

SPEC = {"name": "e2e", "model": "tiny", "steps": 16, "batch_size": 2, "seq_len": 32,
        "layout": {"replicate": 2, "shard": 2}, "data": {"val_every": 0}}
WORLD = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("e2e with a space"))  # Ray runs the command in a shell
    # RAY_ADDRESS unset: the service starts its own head
    holds = os.path.join(root, "holds")  # a job's ranks wait before step s while
    os.makedirs(holds)                      # holds/step_<s> exists
    wrapper = [sys.executable, os.path.join(os.path.dirname(__file__), "_faults.py"),
               "serve", f"hold:{holds}", "--"]
    svc = Service(root, argv=wrapper, DMUON_MAX_RUNNING="1", DMUON_LOCAL_CPUS=str(WORLD),
                  RAY_ADDRESS="")
    svc.holds = holds
    with svc.serving():
        yield svc


def _head(svc) -> dict:
    with open(os.path.join(svc.env["DMUON_STORAGE"], STATE_FILE)) as fh:
        return json.load(fh)


def _wait_status(svc, job_id, wanted, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = svc.request("GET", f"/v1/jobs/{job_id}")[1]["status"]
        if status in wanted:
            return status
        time.sleep(0.5)
    raise TimeoutError(f"{job_id} still {status}")


def _points(page) -> int:
    return page.evaluate("(document.getElementById('loss-chart').data || [{x: []}])[0]"
                         ".x.length")


def _watch_dashboard(svc, job_id, held_step) -> None:
    """The page while the job runs (held before ``held_step`` until the page shows every
    step before it): one bar per rank for ownership and memory, a loss chart that
    gains points, no console errors; a screenshot for people to look at."""
    with page_with_errors() as (page, errors):
        page.goto(f"{svc.url}/#job={job_id}")
        page.wait_for_function(f"document.getElementById('loss-chart').data?.[0].x.length "
                               f"== {held_step - 1}", timeout=180_000)
        seen = _points(page)
        assert svc.request("GET", f"/v1/jobs/{job_id}")[1]["status"] == "RUNNING"
        os.remove(os.path.join(svc.holds, f"step_{held_step}"))
        page.wait_for_function(f"document.getElementById('loss-chart').data[0].x.length > "
                               f"{seen}", timeout=60_000)
        assert page.locator("#ownership-chart .barlayer .point").count() == WORLD
        assert "planned on\nthe cluster's 1 node" in page.locator("#job-facts").inner_text()
        memory = page.evaluate("document.getElementById('memory-chart').data"
                               ".map(t => new Set(t.x).size)")
        assert memory and all(n == WORLD for n in memory)  # stacked kinds, a bar per rank
        assert page.locator("#memory-chart .barlayer .trace").count() == len(memory)
        os.makedirs(ARTIFACTS, exist_ok=True)
        page.screenshot(path=os.path.join(ARTIFACTS, "dashboard.png"), full_page=True)
        assert errors == []


def test_submit_watch_dashboard_follow_events_to_success_and_cancel_another(stack):
    svc = stack
    open(os.path.join(svc.holds, "step_3"), "w").close()
    # this job's blocks run under torch.compile (inductor); tests/test_compile.py holds
    # compiled runs to eager ones
    status, job = svc.request("POST", "/v1/jobs", {"spec": {**SPEC, "compile": True}})
    assert status == 201 and job["status"] == "PENDING"
    assert job["spec"]["compile"]["enabled"] is True
    # max_running=1: the second job waits in the service's queue, then is cancelled
    _, queued = svc.request("POST", "/v1/jobs", {"spec": {**SPEC, "steps": 200}})
    _watch_dashboard(svc, job["id"], held_step=3)
    events = svc.events(job["id"])
    statuses = [e["status"] for e in events if "status" in e]
    assert statuses[-1] == "SUCCEEDED", svc.request("GET", f"/v1/jobs/{job['id']}/logs")[1]
    records = [(e["step"], e["rank"]) for e in events if "step" in e]
    assert sorted(records) == [(s, r) for s in range(1, 17) for r in range(WORLD)]
    metrics = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert len(metrics) == 16 * WORLD  # every step, every rank
    part = svc.request("GET", f"/v1/jobs/{job['id']}/partition")[1]
    assert sum(part["elements_per_rank"]) == sum(p["numel"] for p in part["params"].values())
    assert part["inventory"] == {"source": "cluster", "nodes": 1}  # the head's, not assumed
    _wait_status(svc, queued["id"], {"RUNNING"})
    assert svc.request("POST", f"/v1/jobs/{queued['id']}/cancel")[1]["status"] == "STOPPED"
    status, logs = svc.request("GET", f"/v1/jobs/{job['id']}/logs")
    summary = json.loads(next(line for line in logs.splitlines() if '"summary"' in line))
    assert status == 200 and summary["summary"]["final_step"] == SPEC["steps"]
    assert svc.request("GET", f"/v1/jobs/{job['id']}/logs", token=False)[0] == 401
    from ray.job_submission import JobSubmissionClient

    dashboard = f"http://127.0.0.1:{_head(svc)['dashboard_port']}"
    info = JobSubmissionClient(dashboard).get_job_info(job["id"])
    assert svc.token not in json.dumps(info.dict(), default=str)  # no admin token in Ray
    streamed = subprocess.run(  # logs -f streams ?follow=true, which ends with the job
        [sys.executable, "-m", "service.cli", "logs", "-f", job["id"]], capture_output=True,
        text=True, timeout=120, env={**os.environ, "DMUON_URL": svc.url,
                                      "DMUON_API_TOKEN": svc.token})
    assert streamed.returncode == 0 and '"summary"' in streamed.stdout, streamed.stderr


def test_sigkill_restart_reattaches_keeps_jobs_and_metrics_and_reconciles(stack):
    svc = stack
    head = _head(svc)
    _, job = svc.request("POST", "/v1/jobs", {"spec": {**SPEC, "steps": 20}})
    deadline = time.time() + 240
    while time.time() < deadline and len(svc.request(
            "GET", f"/v1/jobs/{job['id']}/metrics")[1]) < WORLD * 3:
        time.sleep(0.3)
    before = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert len(before) >= WORLD * 3
    svc.kill()  # SIGKILL while the job runs; its posts fail meanwhile, its spool goes on
    time.sleep(3)
    svc.start()
    assert _head(svc) == head  # re-attached to the same head, not a new one
    assert svc.request("GET", f"/v1/jobs/{job['id']}")[1]["status"] in ("RUNNING",
                                                                       "SUCCEEDED")
    assert _wait_status(svc, job["id"], {"SUCCEEDED"}) == "SUCCEEDED"
    after = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    keys = [(m["step"], m["rank"]) for m in after]
    assert keys == [(s, r) for s in range(1, 21) for r in range(WORLD)]  # none lost, no dups
    assert all(m in after for m in before)
