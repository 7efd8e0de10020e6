"""Failures that say why, and dry runs that say what they are (issue 26, items 3 and 7).

End to end: a real ``dmuon-serve`` starting its own local Ray head; a factory model,
uploaded as the job's working_dir, raises ``RuntimeError("boom")`` in ``forward`` at
step 3 on rank 2 only. The job's ``reason`` (type, message, rank, step, frames) comes
back from ``GET /v1/jobs/{id}``, the job list and the status event, with no terminal
escape codes; the full log stays reachable, and ``dmuon-svc logs`` shows the traceback with no
escape codes; Debian's Chromium sees it on the dashboard, and sees a dry run marked as
one; ``dmuon-serve --stop-ray`` then stops the head. One Ray job serves every end-to-end assertion.
Without Ray: the 0001 -> 0002 migration, the reason's sanitising, Ray's worker errors.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from helpers.browser import page_with_errors
from helpers.service_http import Service

from service.job.inputs.working_dir import zip_directory

WORLD = 4
FAIL_RANK, FAIL_STEP = 2, 3
MODEL = '''
import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Boom(nn.Module):
    """Raises in forward at one training step (counted from 1) on one rank."""

    def __init__(self, vocab, dim, layers, rank, step):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.fail_rank, self.fail_step, self.calls = rank, step, 0

    def forward(self, tokens):
        if torch.is_grad_enabled() and tokens.device.type != "meta":
            self.calls += 1  # one training forward per step (no accumulation)
            if dist.get_rank() == self.fail_rank and self.calls == self.fail_step:
                raise RuntimeError("boom")
        x = self.wte(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def build(vocab=256, dim=16, layers=2, rank=2, step=3):
    return Boom(vocab, dim, layers, rank, step)
'''
SPEC = {"name": "boom", "steps": 6, "batch_size": 2, "seq_len": 16,
        "model": {"factory": "boommodel:build", "vocab_size": 256, "max_seq_len": 64,
                  "kwargs": {"rank": FAIL_RANK, "step": FAIL_STEP}},
        "layout": {"replicate": 2, "shard": 2}, "data": {"val_every": 0},
        "checkpoint": {"interval": 0}, "export": {"enabled": False}, "max_failures": 0}
DRY = {"name": "dry", "model": "tiny", "steps": 4, "batch_size": 2, "seq_len": 32,
       "layout": {"replicate": 2, "shard": 2}}


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    """(service, failed job id, dry-run job id), the failed job ended."""
    root = tmp_path_factory.mktemp("failure")
    code = root / "code"
    code.mkdir()
    (code / "boommodel.py").write_text(MODEL)
    svc = Service(str(root), DMUON_MAX_RUNNING="1", DMUON_LOCAL_CPUS=str(WORLD),
                  RAY_ADDRESS="")
    with svc.serving():
        status, package = svc.request("POST", "/v1/packages", data=zip_directory(str(code)),
                                      headers={"Content-Type": "application/zip"})
        assert status == 201, package
        status, job = svc.request("POST", "/v1/jobs",
                                  {"spec": {**SPEC, "working_dir": package["id"]}})
        assert status == 201, job
        status, dry = svc.request("POST", "/v1/jobs", {"spec": DRY, "dry_run": True})
        assert status == 201, dry
        svc.wait_ended(job["id"])
        yield svc, job["id"], dry["id"]


def test_the_first_failing_ranks_exception_is_the_jobs_reason(failed):
    svc, job_id, _ = failed
    resp = requests.get(f"{svc.url}/v1/jobs/{job_id}", timeout=30)
    assert resp.status_code == 200
    assert "\x1b" not in resp.text and "\\u001b" not in resp.text  # no ANSI codes at all
    job = resp.json()
    assert job["status"] == "FAILED", svc.request("GET", f"/v1/jobs/{job_id}/logs")[1][-3000:]
    reason = job["reason"]
    assert (reason["type"], reason["message"], reason["rank"], reason["step"]) == \
        ("RuntimeError", "boom", FAIL_RANK, FAIL_STEP)
    assert (reason["phase"], reason["source"]) == ("step", "worker")
    assert reason["frames"][-1].endswith(" in forward") and "boommodel.py:" in \
        reason["frames"][-1]
    assert 1 < len(reason["frames"]) <= 6
    assert job["message"].startswith("RuntimeError: boom (rank 2, step 3); the full log: ")
    assert job["history"][-1]["status"] == "FAILED"
    assert job["history"][-1]["message"] == job["message"]
    assert job["dry_run"] is False
    listed = [j for j in svc.request("GET", "/v1/jobs")[1] if j["id"] == job_id]
    assert listed[0]["reason"] == reason
    events = svc.events(job_id, timeout_s=60)
    assert events[-1] == {"status": "FAILED", "reason": reason, "message": job["message"]}
    # no rank finished step 3: rank 2 raised in its forward, the others waited for it
    records = svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1]
    assert {r["step"] for r in records} <= {1, 2}
    status, logs = svc.request("GET", f"/v1/jobs/{job_id}/logs")
    assert status == 200 and 'RuntimeError: boom' in logs  # the whole log is still there
    summary = json.loads(next(line for line in logs.splitlines() if '"summary"' in line))
    assert summary["summary"]["reason"]["rank"] == FAIL_RANK


def test_status_and_follow_print_the_reason(failed):
    """``dmuon-svc status JOB`` and the follower ``submit --follow`` runs, on the real
    failed job (its event stream ends at once: the job is over)."""
    import os
    import subprocess
    import sys

    svc, job_id, _ = failed
    env = {**os.environ, "DMUON_URL": svc.url, "DMUON_API_TOKEN": svc.token}
    line = f"FAILED: RuntimeError: boom (rank {FAIL_RANK}, step {FAIL_STEP})"
    status = subprocess.run([sys.executable, "-m", "service.control.cli", "status", job_id],
                            capture_output=True, text=True, timeout=120, env=env)
    assert status.returncode == 0 and line in status.stdout, status.stderr
    follow = subprocess.run(
        [sys.executable, "-c", "import sys; from service.control.cli import follow; "
         f"sys.exit(0 if follow({job_id!r}, {SPEC['steps']}) == 'FAILED' else 1)"],
        capture_output=True, text=True, timeout=120, env=env)
    assert follow.returncode == 0 and f"{job_id}: {line}" in follow.stdout, follow.stderr
    logs = subprocess.run([sys.executable, "-m", "service.control.cli", "logs", job_id],
                          capture_output=True, timeout=120, env=env)  # into a pipe
    assert logs.returncode == 0 and b"\x1b" not in logs.stdout, logs.stderr
    text = logs.stdout.decode()
    # the failure in full: the raising rank's traceback down to the model's frame
    assert "RuntimeError: boom" in text and re.search(
        r'File "[^"]*boommodel\.py", line \d+, in forward', text), text[-4000:]


def test_the_store_keeps_the_reason_and_marks_the_dry_run(failed):
    from service.control.store import JobStore

    svc, job_id, dry_id = failed
    store = JobStore(f"sqlite:///{svc.env['DMUON_DB']}")
    try:
        stored, dry = store.get_job(job_id), store.get_job(dry_id)
    finally:
        store.close()
    assert stored["reason"]["type"] == "RuntimeError" and stored["reason"]["step"] == 3
    assert dry["dry_run"] is True and dry["reason"] is None
    assert dry["message"] == "dry run: planned and stored, never run on Ray"
    job = svc.request("GET", f"/v1/jobs/{dry_id}")[1]
    assert (job["status"], job["dry_run"], job["message"]) == \
        ("SUCCEEDED", True, dry["message"])
    assert job["history"] == [{"status": "SUCCEEDED", "time": job["created"],
                               "message": dry["message"]}]


def test_the_dashboard_shows_why_the_job_failed_and_marks_the_dry_run(failed):
    svc, job_id, dry_id = failed
    with page_with_errors() as (page, errors):
        page.goto(f"{svc.url}/#job={job_id}")
        page.wait_for_selector("#job-reason:not([hidden])", timeout=60_000)
        box = page.locator("#job-reason")
        assert box.locator(".reason-type").inner_text() == "RuntimeError"
        assert box.locator(".reason-message").inner_text() == "boom"
        assert box.locator(".reason-where").inner_text() == "rank 2 \u00b7 step 3 \u00b7 phase step"
        assert "boommodel.py:" in box.locator(".reason-frames").inner_text()
        row = page.locator(f"#jobs tbody tr[data-id='{job_id}'] .status")
        assert row.inner_text() == "FAILED"
        assert row.get_attribute("title") == "RuntimeError: boom (rank 2, step 3)"
        dry_row = page.locator(f"#jobs tbody tr[data-id='{dry_id}'] .status")
        assert dry_row.inner_text() == "DRY RUN"
        dry_row.click()
        page.wait_for_function("document.getElementById('job-title').dataset.dryRun "
                               "=== 'true'", timeout=30_000)
        assert "status\ndry run (planned, never run)" in page.locator("#job-facts").inner_text()
        assert page.locator("#job-reason").is_hidden()
        assert errors == []


def test_stop_ray_stops_the_recorded_head_by_pid(failed):
    """A SIGKILLed service leaves its head (as ``--keep-ray`` does): ``dmuon-serve
    --stop-ray`` stops every process of the head recorded under DMUON_STORAGE and
    forgets it; asked again, it says none is recorded (exit 1)."""
    import os
    import subprocess
    import sys

    from helpers.service_http import alive, head_processes

    svc = failed[0]
    svc.kill()
    head = svc.head()
    processes = head_processes(head)
    assert head["pid"] in processes and alive(processes)
    command = [sys.executable, "-m", "service.control.serve", "--stop-ray"]
    env = {**os.environ, "DMUON_STORAGE": svc.env["DMUON_STORAGE"]}
    stopped = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith(f"stopped the local Ray head (pid {head['pid']}, ")
    assert alive(processes) == set()
    again = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode == 1 and "no local Ray head recorded in" in again.stderr


# -- without Ray ----------------------------------------------------------------------------
def test_a_database_at_0001_gains_the_reason_column(tmp_path):
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine, text

    from service.control.migrate import SCRIPTS
    from service.control.store import JobStore

    url = f"sqlite:///{tmp_path}/old.db"
    engine = create_engine(url)
    with engine.begin() as conn:
        config = Config()
        config.set_main_option("script_location", SCRIPTS)
        config.attributes["connection"] = conn
        command.upgrade(config, "0001")
        columns = [r[1] for r in conn.execute(text("PRAGMA table_info(jobs)"))]
        assert "reason" not in columns  # 0001 as it shipped
        conn.execute(text("INSERT INTO jobs (id, name, spec, status, dry_run, created, "
                          "updated) VALUES ('old', 'o', '{}', 'FAILED', 0, 1, 1)"))
    engine.dispose()
    store = JobStore(url)
    try:
        assert store.get_job("old")["reason"] is None
        job, _ = store.create_job("n", {}, dry_run=False, plan=None)
        store.queue.settle(job["id"], "FAILED", "\x1b[31mred\x1b[0m tail",
                     {"type": "ValueError", "message": "x"})
        settled = store.get_job(job["id"])
        assert settled["reason"] == {"type": "ValueError", "message": "x"}
        assert settled["message"] == "red tail"
    finally:
        store.close()


def test_reasons_are_sanitised_and_messages_stripped():
    from service.control.submitter import outcome_message
    from service.job.failure import sanitized, strip_ansi

    ray_tail = "\x1b[36m(RayTrainWorker pid=1)\x1b[0m Traceback\x1b]8;;http://x\x07link\x1b]8;;\x07"
    assert strip_ansi(ray_tail) == "(RayTrainWorker pid=1) Traceback" + "link"
    assert outcome_message("j", ray_tail, None) == strip_ansi(ray_tail)
    raw = {"type": "\x1b[1mE\x1b[0m", "message": "m" * 5000 + "\ud800", "rank": True,
           "step": -1, "frames": ["a.py:1 in f", 7] * 10, "time": float("nan"),
           "extra": "dropped", "phase": "step"}
    clean = sanitized(raw)
    assert clean["type"] == "E" and len(clean["message"]) == 2000
    assert (clean["rank"], clean["step"], clean["time"]) == (None, None, None)
    assert clean["frames"] == ["a.py:1 in f"] * 3 and "extra" not in clean
    assert sanitized({"message": "no type"}) is None and sanitized([1]) is None
    reason = {**clean, "type": "RuntimeError", "message": "boom", "rank": 2, "step": 3}
    assert outcome_message("j", ray_tail, reason) == \
        "RuntimeError: boom (rank 2, step 3); the full log: GET /v1/jobs/j/logs " \
        "(dmuon-svc logs j)"


def test_a_worker_that_died_without_an_exception_is_described_by_the_entrypoint(tmp_path):
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import WorkerGroupError

    from service.driver.job_driver import failure_reason

    text = ('Traceback (most recent call last):\n  File "/a/loop.py", line 9, in step\n'
            '    x()\n  File "/u/model.py", line 4, in forward\n    raise KeyError(1)\n'
            'KeyError: 1\n')
    error = WorkerGroupError("two failed", {3: RuntimeError("late"), 1: UserExceptionWithTraceback(
        KeyError("k"), text)})
    path = str(tmp_path / "job" / "failure.json")
    reason = failure_reason(error, path)
    assert (reason["type"], reason["message"], reason["rank"], reason["source"]) == \
        ("KeyError", "'k'", 1, "entrypoint")
    assert reason["frames"] == ["/a/loop.py:9 in step", "/u/model.py:4 in forward"]
    # a worker's own description, written first, wins over the entrypoint's
    assert failure_reason(RuntimeError("other"), path) == reason
