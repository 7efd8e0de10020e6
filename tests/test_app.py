"""The control plane under real uvicorn on 127.0.0.1 with its SQLite store (no Ray)."""

from __future__ import annotations

import json

import pytest
from _http import Service

TINY = {"model": "tiny", "steps": 5, "layout": {"replicate": 2, "shard": 2}}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    service = Service(str(tmp_path_factory.mktemp("svc")), DMUON_LOCAL_RAY="0")
    yield service
    service.kill()


def test_health_version_and_auth(svc):
    assert svc.request("GET", "/healthz", token=False) == (200, {"status": "ok"})
    status, body = svc.request("GET", "/version", token=False)
    assert status == 200 and body["dmuon"]
    status, _ = svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True}, token=False)
    assert status == 401
    status, _ = svc.request("POST", "/v1/metrics", [], token=False)
    assert status == 401


def test_dry_run_plans_and_reports_partition(svc):
    status, job = svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True})
    assert status == 201 and job["status"] == "SUCCEEDED" and job["dry_run"]
    status, part = svc.request("GET", f"/v1/jobs/{job['id']}/partition")
    assert status == 200 and part["layout"]["replicate"] == 2 and len(part["ranks"]) == 4
    owners = {p["owner"] for p in part["params"].values()}
    assert owners == {0, 1, 2, 3} and part["imbalance"] >= 1.0
    status, plan = svc.request("POST", "/v1/plan", TINY, token=False)
    assert status == 200 and plan["partition"]["params"] == part["params"]


def test_idempotency_key_returns_the_same_job(svc):
    headers = {"Idempotency-Key": "retry-me-1"}
    first = svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True}, headers=headers)
    again = svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True}, headers=headers)
    assert first[1]["id"] == again[1]["id"]
    ids = [j["id"] for j in svc.request("GET", "/v1/jobs")[1]]
    assert ids.count(first[1]["id"]) == 1
    other = svc.request("POST", "/v1/jobs", {"spec": {**TINY, "steps": 6}, "dry_run": True},
                        headers=headers)
    assert other[0] == 409 and first[1]["id"] in other[1]["detail"]
    assert len(svc.request("GET", "/v1/jobs")[1]) == len(ids)  # nothing new was made


@pytest.mark.parametrize("spec,field", [
    ({"model": "tiny", "steps": -1}, "spec.steps"),
    ({"model": "nope"}, "spec.model"),
    ({"model": "tiny", "optimizer": {"typo": 1}}, "spec.optimizer.typo"),
])
def test_invalid_specs_get_422_with_the_field_path(svc, spec, field):
    status, body = svc.request("POST", "/v1/jobs", {"spec": spec})
    assert status == 422 and field in [d["field"] for d in body["detail"]]


def test_impossible_layout_is_refused(svc):
    spec = {**TINY, "layout": {"replicate": 1, "shard": 7}}
    status, body = svc.request("POST", "/v1/jobs", {"spec": spec})
    assert status == 422 and "cannot be split evenly" in json.dumps(body)


def test_metrics_ingest_is_deduplicated_and_streamed(svc):
    _, job = svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True})
    records = [{"job_id": job["id"], "step": s, "rank": r, "loss": 5.0 - s}
               for s in (1, 2) for r in range(4)]
    assert svc.request("POST", "/v1/metrics", records)[1] == {"inserted": 8}
    assert svc.request("POST", "/v1/metrics", records)[1] == {"inserted": 0}
    status, stored = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")
    assert status == 200 and [(m["step"], m["rank"]) for m in stored] == \
        [(s, r) for s in (1, 2) for r in range(4)]
    events = svc.events(job["id"], timeout_s=30)
    assert sorted((e["step"], e["rank"]) for e in events if "step" in e) == \
        [(s, r) for s in (1, 2) for r in range(4)]
    assert [e["status"] for e in events if "status" in e][-1] == "SUCCEEDED"


def test_pending_job_without_ray_can_be_cancelled(svc):
    _, job = svc.request("POST", "/v1/jobs", {"spec": TINY})
    assert job["status"] == "PENDING"
    status, cancelled = svc.request("POST", f"/v1/jobs/{job['id']}/cancel")
    assert status == 200 and cancelled["status"] == "STOPPED"
    history = svc.request("GET", f"/v1/jobs/{job['id']}")[1]["history"]
    assert [h["status"] for h in history] == ["PENDING", "STOPPED"]


def test_prometheus_counts_jobs_by_status(svc):
    status, text = svc.request("GET", "/metrics", token=False)
    counts = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("dmuon_"))
    jobs = svc.request("GET", "/v1/jobs?limit=1000")[1]
    assert status == 200
    assert int(counts['dmuon_jobs{status="STOPPED"}']) == sum(j["status"] == "STOPPED"
                                                             for j in jobs)


def test_500_concurrent_submissions_lose_nothing(svc):
    from concurrent.futures import ThreadPoolExecutor

    def submit(i):  # two of every three are one request sent twice with the same key
        key = {"Idempotency-Key": f"load-{i // 3}"} if i % 3 else {}
        name = f"load-keyed-{i // 3}" if i % 3 else f"load-{i}"
        return svc.request("POST", "/v1/jobs",
                           {"spec": {**TINY, "name": name}, "dry_run": True},
                           headers=key, timeout=120)

    before = {j["id"] for j in svc.request("GET", "/v1/jobs?limit=100000")[1]}
    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(submit, range(500)))
    assert all(status == 201 for status, _ in results), {s for s, _ in results}
    ids = [job["id"] for _, job in results]
    keyed = {}
    for i, job_id in enumerate(ids):
        if i % 3:
            keyed.setdefault(i // 3, set()).add(job_id)
    assert all(len(v) == 1 for v in keyed.values())  # retries with a key: one job each
    expected = len({job_id for i, job_id in enumerate(ids) if i % 3 == 0}) + len(keyed)
    stored = {j["id"] for j in svc.request("GET", "/v1/jobs?limit=100000")[1]} - before
    assert stored == set(ids) and len(stored) == expected


def test_cli_submit_status_plan_cancel(svc, tmp_path):
    import os
    import subprocess
    import sys

    spec = tmp_path / "job.yaml"
    spec.write_text("model: tiny\nsteps: 5\nlayout: {replicate: 2, shard: 2}\n")
    env = {**os.environ, "DMUON_URL": svc.url, "DMUON_API_TOKEN": svc.token}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "service.cli", *args], env=env,
                              capture_output=True, text=True, timeout=60)

    submitted = cli("submit", str(spec), "--dry-run", "--follow")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    assert f"{job_id}: SUCCEEDED" in submitted.stdout
    assert "SUCCEEDED" in cli("status", job_id).stdout
    assert json.loads(cli("plan", str(spec)).stdout) == {"replicate": 2, "shard": 2,
                                                         "nodes": 1}
    pending = cli("submit", str(spec)).stdout.split()[0]
    assert cli("cancel", pending).stdout.strip() == "STOPPED"
    spec.write_text("model: tiny\nsteps: 0\n")
    bad = cli("submit", str(spec))
    assert bad.returncode == 1 and "steps:" in bad.stderr
    denied = subprocess.run([sys.executable, "-m", "service.cli", "cancel", pending],
                            env={**env, "DMUON_API_TOKEN": "wrong"}, capture_output=True,
                            text=True, timeout=60)
    assert denied.returncode == 1 and "401" in denied.stderr


def test_database_url_setting_names_sqlite_files_and_refuses_other_engines(tmp_path):
    from service.settings import Settings

    absolute = tmp_path / "jobs.db"
    assert Settings(database_url=f"sqlite:///{absolute}").sqlite_path() == str(absolute)
    assert Settings(database_url="sqlite:///rel/jobs.db").sqlite_path() == "rel/jobs.db"
    assert Settings(db_path="x.db", database_url=None).sqlite_path() == "x.db"
    for url in ("postgresql://db/jobs", "sqlite://", "jobs.db"):
        with pytest.raises(ValueError, match="DMUON_DATABASE_URL"):
            Settings(database_url=url).sqlite_path()
