"""The job store across processes and on bad files: two services on one database
(SQLite and PostgreSQL) under a burst with retried idempotency keys and a SIGKILL, a
malformed spool line, read-only and corrupt SQLite files."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from helpers.service_http import Service

TINY = {"model": "tiny", "steps": 5, "layout": {"replicate": 2, "shard": 2}}
SUBMISSIONS = 500


def _submit_with_retries(services, i: int, alive: list[bool]) -> tuple[int, str]:
    """Submission ``i`` with its own key, sent to one service and retried (same key) on
    the other: after any failure, and once more after success (a client that lost the
    answer). Returns (last status, job id)."""
    order = [services[i % 2], services[1 - i % 2]]
    body = json.dumps({"spec": {**TINY, "name": f"burst-{i}"}, "dry_run": True})
    answers = []
    for attempt in range(4):
        svc = order[attempt % 2]
        try:
            resp = requests.post(f"{svc.url}/v1/jobs", data=body, timeout=120, headers={
                "Authorization": f"Bearer {svc.token}", "Idempotency-Key": f"burst-{i}",
                "Content-Type": "application/json"})
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
            # refused, or killed between the answer's headers and its body: either way
            # the client has no answer and retries with the same key, as clients must
            assert not alive[services.index(svc)], "a live service broke a connection"
            continue
        assert resp.status_code < 500, resp.text
        answers.append((resp.status_code, resp.json()["id"]))
        if len(answers) == 2:
            break
    assert answers and {a[0] for a in answers} <= {200, 201}, answers
    assert len({job_id for _, job_id in answers}) == 1, answers  # the same job each time
    return answers[-1]


@pytest.fixture(params=["sqlite", "postgresql"])
def two_services(request, tmp_path):
    env = {"DMUON_LOCAL_RAY": "0"}
    if request.param == "postgresql":
        env["DMUON_DATABASE_URL"] = request.getfixturevalue("postgres").database()
    else:
        env["DMUON_DATABASE_URL"] = f"sqlite:///{tmp_path}/shared.db"
    services = [Service(str(tmp_path), **env)]
    services.append(Service(str(tmp_path), **env))
    yield services
    for svc in services:
        svc.kill()


def test_two_processes_burst_with_retries_and_a_kill_lose_nothing(two_services):
    a, b = two_services
    alive, done = [True, True], []

    def one(i):
        result = _submit_with_retries(two_services, i, alive)
        done.append(i)
        if len(done) == SUBMISSIONS // 2 and alive[0]:
            alive[0] = False
            a.kill()  # SIGKILL mid-burst; its clients retry on b with the same key
        return result

    with ThreadPoolExecutor(max_workers=32) as pool:
        acknowledged = list(pool.map(one, range(SUBMISSIONS)))
    assert not alive[0] and a.proc.returncode is not None
    stored = {j["name"]: j["id"] for j in b.request("GET", "/v1/jobs?limit=10000")[1]}
    assert len(stored) == SUBMISSIONS  # one job per key: no duplicate, none lost
    for i, (_, job_id) in enumerate(acknowledged):
        assert stored[f"burst-{i}"] == job_id  # every acknowledged job is there


def test_malformed_spool_line_loses_only_itself(tmp_path):
    from service.control.step_records import read_spool
    from service.control.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path}/db.sqlite")
    try:
        job, _ = store.create_job("j", {}, dry_run=False, plan=None)
        lines = [json.dumps({"job_id": job["id"], "step": 1, "rank": 0, "loss": 1.0}),
                 '{"job_id": "' + job["id"] + '", "step": 2, "ra',  # torn, then complete
                 json.dumps({"job_id": job["id"], "step": 3, "rank": 0, "loss": NAN}),
                 json.dumps({"job_id": job["id"], "step": "four", "rank": 0})]
        spool = tmp_path / "metrics.jsonl"
        spool.write_text("\n".join(lines) + "\n" + '{"job_id": "' + job["id"])
        stored, problems = read_spool(store, job["id"], str(spool), 0)
        assert stored == 2 and [m["step"] for m in store.records.all(job["id"])] == [1, 3]
        assert len(problems) == 2 and "line 2" in problems[0] and "step" in problems[1]
        offset = sum(len(line) + 1 for line in lines)
        assert store.queue.on_ray() == [] and _offset(store, job["id"]) == offset
        with open(spool, "a") as fh:  # the half-written last line completes
            fh.write('", "step": 5, "rank": 0}\n')
        assert read_spool(store, job["id"], str(spool), offset) == (1, [])
    finally:
        store.close()


NAN = float("nan")


def _offset(store, job_id):
    from sqlalchemy import select

    from service.control.sql_tables import jobs

    with store.reader.connect() as conn:
        return conn.execute(select(jobs.c.spool_offset).where(jobs.c.id == job_id)).scalar()


def _serve(tmp_path, db):
    env = {**os.environ, "DMUON_DB": str(db), "DMUON_LOCAL_RAY": "0",
           "DMUON_API_TOKEN": "t", "DMUON_STORAGE": str(tmp_path / "runs")}
    return subprocess.run([sys.executable, "-m", "service.control.serve", "--port", "9"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_read_only_and_corrupt_database_files_stop_the_service_with_the_path(tmp_path):
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not a database" * 100)
    out = _serve(tmp_path, corrupt)
    assert out.returncode == 2 and str(corrupt) in out.stderr
    assert "file is not a database" in out.stderr and "Traceback" not in out.stderr
    read_only = tmp_path / "ro.db"
    sqlite3.connect(read_only).close()  # an empty, valid file
    os.chmod(read_only, 0o444)
    # root ignores file modes: the database's directory is made read-only by a bind mount
    # if we are root, else the mode is enough
    if os.geteuid() == 0:
        out = _read_only_as_root(tmp_path, read_only)
    else:
        out = _serve(tmp_path, read_only)
    assert out.returncode == 2 and str(read_only) in out.stderr, out.stderr
    assert "readonly" in out.stderr and "Traceback" not in out.stderr


def _read_only_as_root(tmp_path, db):
    """Serve ``db`` from a read-only bind mount of its folder, in a mount namespace of
    its own (root writes any file whatever its mode)."""
    folder = str(db.parent)
    env = {**os.environ, "DMUON_DB": str(db), "DMUON_LOCAL_RAY": "0",
           "DMUON_API_TOKEN": "t", "DMUON_STORAGE": str(tmp_path.parent / "runs")}
    script = (f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && "
              f"exec {sys.executable} -m service.control.serve --port 9")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)


def test_sqlite_runs_in_wal_mode_with_pooled_connections(tmp_path):
    from service.control.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path}/db.sqlite")
    try:
        errors = []

        def create(i):
            try:
                store.create_job(f"j{i}", {}, dry_run=True, plan=None, idempotency_key="same")
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and len(store.list_jobs()) == 1
    finally:
        store.close()
    assert sqlite3.connect(tmp_path / "db.sqlite").execute(
        "PRAGMA journal_mode").fetchone() == ("wal",)
