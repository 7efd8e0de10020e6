"""The control plane under real uvicorn on 127.0.0.1 (no Ray), on SQLite and on a real
PostgreSQL server: the REST surface, and each defect of issue #15 by its exact input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from helpers.service_http import Service, strict_json

from service.job.layout import Layout

TINY = {"model": "tiny", "steps": 5, "layout": {"replicate": 2, "shard": 2}}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def svc(request, tmp_path_factory):
    env = {"DMUON_LOCAL_RAY": "0"}
    if request.param == "postgresql":
        env["DMUON_DATABASE_URL"] = request.getfixturevalue("postgres").database()
    service = Service(str(tmp_path_factory.mktemp(request.param)), **env)
    service.engine = request.param
    yield service
    service.kill()


def _dry(svc, spec=TINY, **kw):
    status, job = svc.request("POST", "/v1/jobs", {"spec": spec, "dry_run": True}, **kw)
    assert status == 201, job
    return job


def _fields(body) -> list[str]:
    return [d["field"] for d in body["detail"]]


def test_health_version_and_auth(svc):
    assert svc.request("GET", "/healthz", token=False) == (200, {"status": "ok"})
    status, body = svc.request("GET", "/version", token=False)
    assert status == 200 and body["dmuon"] and body["torch"]
    assert svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True},
                       token=False)[0] == 401


def test_dry_run_plans_and_reports_partition(svc):
    job = _dry(svc)
    assert job["status"] == "SUCCEEDED" and job["dry_run"]
    status, part = svc.request("GET", f"/v1/jobs/{job['id']}/partition")
    assert status == 200 and part["layout"]["replicate"] == 2 and len(part["ranks"]) == 4
    owners = {p["owner"] for p in part["params"].values()}
    assert owners == {0, 1, 2, 3} and part["imbalance"] >= 1.0
    status, plan = svc.request("POST", "/v1/plan", TINY)
    assert status == 200 and plan["partition"]["params"] == part["params"]
    assert plan["scaling"]["num_workers"] == 4


def test_idempotency_key_returns_the_same_job(svc):
    headers = {"Idempotency-Key": f"retry-me-{svc.engine}"}
    first = svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True}, headers=headers)
    again = svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True}, headers=headers)
    assert (first[0], again[0]) == (201, 200) and first[1]["id"] == again[1]["id"]
    ids = [j["id"] for j in svc.request("GET", "/v1/jobs?limit=10000")[1]]
    assert ids.count(first[1]["id"]) == 1
    other = svc.request("POST", "/v1/jobs", {"spec": {**TINY, "steps": 6}, "dry_run": True},
                        headers=headers)
    assert other[0] == 409 and first[1]["id"] in other[1]["detail"]
    assert len(svc.request("GET", "/v1/jobs?limit=10000")[1]) == len(ids)


def test_impossible_layout_is_refused(svc):
    spec = {**TINY, "layout": {"replicate": 1, "shard": 7}}
    status, body = svc.request("POST", "/v1/jobs", {"spec": spec})
    assert status == 422 and "cannot be split evenly" in json.dumps(body)


def test_pending_job_without_ray_can_be_cancelled(svc):
    _, job = svc.request("POST", "/v1/jobs", {"spec": TINY})
    assert job["status"] == "PENDING"
    status, cancelled = svc.request("POST", f"/v1/jobs/{job['id']}/cancel")
    assert status == 200 and cancelled["status"] == "STOPPED"
    history = svc.request("GET", f"/v1/jobs/{job['id']}")[1]["history"]
    assert [h["status"] for h in history] == ["PENDING", "STOPPED"]
    assert svc.request("POST", "/v1/jobs/dmuon-nope/cancel")[0] == 404


def test_registration_and_log_tails_are_validated_naming_the_field(svc):
    """A `ray job submit` job's registration names what is wrong: a spec field, the
    submission id's form, or (no Ray attached here) a submission this service cannot
    follow; nothing is stored. A log tail is bounded and is not for a stream."""
    before = svc.request("GET", "/v1/jobs?limit=10000")[1]
    cases = [({"spec": {**TINY, "steps": 0}, "submission_id": "raysubmit_a"}, "spec.steps"),
             ({"spec": TINY, "submission_id": "no spaces"}, "submission_id"),
             ({"spec": TINY}, "submission_id"),
             ({"spec": TINY, "submission_id": "raysubmit_a", "plan": {}}, "plan"),
             ({"spec": TINY, "submission_id": "raysubmit_a"}, "submission_id")]
    for body, field in cases:
        status, answer = svc.request("POST", "/v1/jobs/register", body)
        assert status == 422 and _fields(answer) == [field], (body, answer)
    assert "no Ray cluster attached" in answer["detail"][0]["message"]
    assert svc.request("GET", "/v1/jobs?limit=10000")[1] == before
    logs = f"/v1/jobs/{_dry(svc)['id']}/logs"
    for query in ("tail=0", "tail=100001", "tail=x", "tail=5&follow=true"):
        status, answer = svc.request("GET", f"{logs}?{query}")
        assert status == 422 and _fields(answer) == ["query.tail"], (query, answer)
    assert svc.request("GET", f"{logs}?tail=5") == (200, "")  # a dry run has no log


def test_an_entrypoint_registers_only_under_ray_job_submit(monkeypatch, capsys):
    """DMUON_URL alone (no Ray submission id: not `ray job submit`) registers nothing and
    says so; a submitted job with its own --plan is refused, not silently re-planned;
    a job id from the control plane means it is the service's own job."""
    import argparse
    import json as _json

    from service.driver import register

    args = argparse.Namespace(job_id=None, plan=None, metrics_url=None, plan_url=None)
    monkeypatch.setenv("DMUON_URL", "http://127.0.0.1:9")  # nothing listens: never asked
    monkeypatch.delenv(register.JOB_CONFIG_ENV, raising=False)
    assert register.register_if_submitted(args, None, "plan", "token") == ("plan", "token")
    assert "not started by `ray job submit`" in capsys.readouterr().err
    assert (args.job_id, args.metrics_url) == (None, None)
    monkeypatch.setenv(register.JOB_CONFIG_ENV, _json.dumps(
        {"metadata": {"job_submission_id": "raysubmit_x"}}))
    assert register.submission_id() == "raysubmit_x"
    with pytest.raises(register.RegistrationError, match="--plan with DMUON_URL"):
        register.register_if_submitted(argparse.Namespace(**{**vars(args), "plan": "p"}),
                                       None, None, None)
    given = argparse.Namespace(**{**vars(args), "job_id": "dmuon-000000000000"})
    assert register.register_if_submitted(given, None, "plan", None) == ("plan", None)


def test_prometheus_counts_jobs_by_status(svc):
    status, text = svc.request("GET", "/metrics", token=False)
    counts = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("dmuon_"))
    jobs = svc.request("GET", "/v1/jobs?limit=10000")[1]
    assert status == 200
    assert float(counts['dmuon_jobs{status="STOPPED"}']) == sum(j["status"] == "STOPPED"
                                                               for j in jobs)


# -- defect 1: one non-finite float broke the job list for everyone ------------------------
@pytest.mark.parametrize("raw,field", [
    ('{"spec":{"optimizer":{"lr":1e999}},"dry_run":true}', "spec.optimizer.lr"),
    ('{"spec":{"optimizer":{"lr":NaN}},"dry_run":true}', "spec.optimizer.lr"),
    ('{"spec":{"optimizer":{"ns_coefficients":[3.4,-4.7,1e999]}},"dry_run":true}',
     "spec.optimizer.ns_coefficients[2]"),
    ('{"spec":{"optimizer":{"adamw_betas":[0.9,NaN]}},"dry_run":true}',
     "spec.optimizer.adamw_betas[1]"),
    ('{"spec":{"resources_per_worker":{"custom":{"tpu":1e999}}},"dry_run":true}',
     "spec.resources_per_worker.custom.tpu"),
    # not a float, but a refusal that reads two fields: named by the one to change
    ('{"spec":{"compile":{"enabled":true,"mode":"reduce-overhead"}},"dry_run":true}',
     "spec.compile.mode"),
])
def test_non_finite_floats_are_refused_and_the_job_list_stays_up(svc, raw, field):
    before = svc.request("GET", "/v1/jobs?limit=10000")[1]
    status, body = svc.request("POST", "/v1/jobs", data=raw.encode())
    assert status == 422 and _fields(body) == [field], body
    status, after = svc.request("GET", "/v1/jobs?limit=10000")
    assert status == 200 and after == before  # nothing committed, the list parses


# -- defect 2: one NaN metric broke that job's metrics for good ----------------------------
def test_nan_loss_is_stored_as_null_and_stays_json(svc):
    job = _dry(svc)
    raw = (f'[{{"job_id":"{job["id"]}","step":1,"rank":0,"loss":NaN,"val_loss":Infinity}},'
           f'{{"job_id":"{job["id"]}","step":1,"rank":1,"loss":2.5}}]')
    status, body = svc.request("POST", f"/v1/jobs/{job['id']}/metrics", data=raw.encode())
    assert (status, body) == (200, {"inserted": 2})
    status, stored = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")
    assert status == 200 and stored[0]["loss"] is None and stored[1]["loss"] == 2.5
    assert stored[0]["nonfinite"] == ["loss", "val_loss"]
    events = svc.events(job["id"], timeout_s=30)  # parsed as strict JSON, as a browser does
    assert [e.get("loss") for e in events if "step" in e] == [None, 2.5]


def test_metrics_ingest_is_deduplicated_and_streamed(svc):
    job = _dry(svc)
    records = [{"job_id": job["id"], "step": s, "rank": r, "loss": 5.0 - s}
               for s in (1, 2) for r in range(4)]
    path = f"/v1/jobs/{job['id']}/metrics"
    assert svc.request("POST", path, records)[1] == {"inserted": 8}
    assert svc.request("POST", path, records)[1] == {"inserted": 0}
    status, stored = svc.request("GET", path)
    assert status == 200 and [(m["step"], m["rank"]) for m in stored] == \
        [(s, r) for s in (1, 2) for r in range(4)]
    events = svc.events(job["id"], timeout_s=30)
    assert sorted((e["step"], e["rank"]) for e in events if "step" in e) == \
        [(s, r) for s in (1, 2) for r in range(4)]
    assert [e["status"] for e in events if "status" in e][-1] == "SUCCEEDED"
    resumed = svc.events(job["id"], timeout_s=30, headers={"Last-Event-ID": "0"})
    assert len([e for e in resumed if "step" in e]) == 8


# -- defect 5: auth defaults -----------------------------------------------------------------
def test_empty_and_non_ascii_bearer_tokens_get_401(svc):
    for header in ("bearer", "Bearer ", "Bearer \u00e9t\u00e9", "Bearer secret-token\u00e9"):
        status, _ = svc.request("POST", "/v1/jobs", {"spec": TINY, "dry_run": True},
                                token=False, headers={"Authorization": header.encode()
                                                      .decode("latin-1")})
        assert status == 401, header
    raw = {"Authorization": b"Bearer \xc3\xa9\xff"}  # bytes no str encoding takes back
    import requests

    resp = requests.post(f"{svc.url}/v1/jobs", data=b"{}", headers=raw, timeout=30)
    assert resp.status_code == 401


def test_plan_needs_the_token_and_bodies_are_bounded_before_reading(svc):
    assert svc.request("POST", "/v1/plan", TINY, token=False)[0] == 401
    big = b'{"spec": {"name": "' + b"x" * (2 << 20) + b'"}}'
    for token in (False, True):
        status, answer = svc.request("POST", "/v1/jobs", data=big, token=token)
        assert status == 413, token
        # JSON naming the limit, as every other refusal (not a bare text/plain 413)
        assert answer == {"detail": "the request body is too large: POST /v1/jobs takes a "
                                    "body of at most 64 KiB", "max_body_bytes": 65536}
    job = _dry(svc)
    fifty_mb = b"[" + b"1," * (25 << 20) + b"1]"
    status, answer = svc.request("POST", f"/v1/jobs/{job['id']}/metrics", data=fifty_mb)
    assert status == 413 and answer["max_body_bytes"] == 4 << 20


def test_empty_token_setting_and_an_open_public_bind_are_refused(tmp_path):
    env = {**os.environ, "DMUON_DB": str(tmp_path / "db.sqlite"), "DMUON_LOCAL_RAY": "0"}
    serve = [sys.executable, "-m", "service.control.serve", "--port", "9"]
    empty = subprocess.run(serve, env={**env, "DMUON_API_TOKEN": " "}, capture_output=True,
                           text=True, timeout=120)
    assert empty.returncode == 2 and "DMUON_API_TOKEN is set but empty" in empty.stderr
    env.pop("DMUON_API_TOKEN", None)
    public = subprocess.run([*serve, "--host", "0.0.0.0"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert public.returncode == 2 and "DMUON_API_TOKEN is unset" in public.stderr


@pytest.fixture(scope="module")
def open_svc(tmp_path_factory):
    """No token: loopback only, and no cross-site change."""
    service = Service(str(tmp_path_factory.mktemp("open")), token=None, DMUON_LOCAL_RAY="0")
    yield service
    service.kill()


def test_without_a_token_cross_site_requests_cannot_cancel(open_svc):
    _, job = open_svc.request("POST", "/v1/jobs", {"spec": TINY})
    cancel = f"/v1/jobs/{job['id']}/cancel"
    for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Host": "evil.example"}):
        status, body = open_svc.request("POST", cancel, headers=headers)
        assert status == 403, (headers, body)
    assert open_svc.request("GET", f"/v1/jobs/{job['id']}")[1]["status"] == "PENDING"
    assert open_svc.request("GET", "/v1/jobs", headers={"Host": "evil.example"})[0] == 403
    same = {"Origin": open_svc.url}
    assert open_svc.request("POST", cancel, headers=same)[1]["status"] == "STOPPED"


# -- defect 6: metric ingest accepted anything ------------------------------------------------
def test_metric_ingest_refuses_wrong_types_unknown_jobs_and_other_jobs_tokens(svc):
    job = _dry(svc)
    path = f"/v1/jobs/{job['id']}/metrics"
    status, body = svc.request("POST", path, [{"job_id": job["id"], "step": "one",
                                               "rank": 0, "memory": {"x": "big"}}])
    assert status == 422 and set(_fields(body)) == {"[0].step", "[0].memory.x"}
    status, _ = svc.request("POST", "/v1/jobs/dmuon-000000000000/metrics",
                            [{"job_id": "dmuon-000000000000", "step": 1, "rank": 0}])
    assert status == 404
    status, body = svc.request("POST", path, [{"job_id": "other", "step": 1, "rank": 0}])
    assert status == 422 and _fields(body) == ["[0].job_id"]
    assert svc.request("POST", path, [], token="not-this-jobs-token")[0] == 401
    too_many = [{"job_id": job["id"], "step": s, "rank": 0} for s in range(1001)]
    assert svc.request("POST", path, too_many)[0] == 422
    # what a worker sends: the whole Layout it ran, its schedule's name among the counts
    ran = dataclasses.asdict(Layout(2, 2, 1, pp=2, pp_schedule="gpipe", micro_batches=2,
                                    rows_per_micro=1, workers_per_node=8))
    record = {"job_id": job["id"], "step": 1, "rank": 0, "ran_layout": ran}
    assert svc.request("POST", path, [record])[0] == 200
    status, body = svc.request("POST", path, [{**record, "ran_layout": {
        **ran, "pp_schedule": "zb"}}])
    assert status == 422 and _fields(body) == ["[0].ran_layout.pp_schedule"]


def test_a_posted_record_cannot_hide_the_jobs_own(svc, tmp_path):
    """An injected post first, then the job's spool: the spool's record wins, and the
    event stream sends the correction."""
    from service.control.settings import Settings
    from service.control.step_records import read_spool
    from service.control.store import JobStore

    job = _dry(svc)
    fake = {"job_id": job["id"], "step": 1, "rank": 0, "loss": 0.001}
    assert svc.request("POST", f"/v1/jobs/{job['id']}/metrics", [fake])[1]["inserted"] == 1
    spool = tmp_path / "metrics.jsonl"
    spool.write_text(json.dumps({**fake, "loss": 5.5}) + "\n")
    store = JobStore(Settings(db=svc.env["DMUON_DB"],
                              database_url=svc.env.get("DMUON_DATABASE_URL")).store_url())
    try:
        assert read_spool(store, job["id"], str(spool), 0) == (1, [])
    finally:
        store.close()
    stored = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert [m["loss"] for m in stored] == [5.5]
    assert [e["loss"] for e in svc.events(job["id"], timeout_s=30) if "step" in e] == [5.5]


# -- defect 7: other 500s ---------------------------------------------------------------------
def test_lone_surrogates_and_huge_integers_get_422(svc):
    status, body = svc.request("POST", "/v1/jobs",
                               data=b'{"spec": {"name": "\\ud800"}, "dry_run": true}')
    assert status == 422 and _fields(body) == ["spec.name"]
    job = _dry(svc)
    status, body = svc.request("GET", f"/v1/jobs/{job['id']}/metrics?after_step={10**20}")
    assert status == 422 and _fields(body) == ["query.after_step"]
    status, body = svc.request("GET", f"/v1/jobs/{job['id']}/events",
                               headers={"Last-Event-ID": str(10**20)})
    assert status == 422 and _fields(body) == ["header.last-event-id"]
    status, body = svc.request("POST", "/v1/jobs", {"spec": {"seed": 10**20}})
    assert status == 422 and _fields(body) == ["spec.seed"]


# -- defect 9: specs not checked before workers start -----------------------------------------
@pytest.mark.parametrize("spec,field", [
    ({"data": {"source": "/dev/zero"}}, "spec.data.source"),
    ({"data": {"source": "../../etc/passwd"}}, "spec.data.source"),
    ({"data": {"source": "missing.txt"}}, "spec.data.source"),
    ({"checkpoint": {"storage_path": "/somewhere"}}, "spec.checkpoint.storage_path"),
    ({"model": "tiny", "seq_len": 65}, "spec.seq_len"),
    ({"seed": 9_300_000_000_000}, "spec.seed"),
    ({"name": "x" * 129}, "spec.name"),
    ({"steps": "5"}, "spec.steps"),
    ({"model": {"dim": "wide", "n_layers": 1, "n_heads": 1, "n_kv_heads": 1,
                "ffn_dim": 8}}, "spec.model.dim"),
    ({"model": {"dim": 10, "n_layers": 1, "n_heads": 3, "n_kv_heads": 1, "ffn_dim": 8}},
     "spec.model"),
    ({"dmuon": {"ns_backend": "gram"}}, "spec.dmuon"),
])
def test_specs_are_checked_before_any_worker(svc, spec, field):
    status, body = svc.request("POST", "/v1/jobs", {"spec": spec})
    assert status == 422 and _fields(body) == [field], body


def test_a_data_file_under_the_data_root_is_accepted(svc):
    root = os.path.join(svc.env["DMUON_STORAGE"], "data")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "corpus.txt"), "w") as fh:
        fh.write("hello " * 1000)
    status, job = svc.request("POST", "/v1/jobs",
                              {"spec": {**TINY, "data": {"source": "corpus.txt"}}})
    assert status == 201 and job["spec"]["data"]["source"] == "corpus.txt"
    svc.request("POST", f"/v1/jobs/{job['id']}/cancel")


def test_cli_submit_status_plan_cancel(svc, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("model: tiny\nsteps: 5\nlayout: {replicate: 2, shard: 2}\n")
    env = {**os.environ, "DMUON_URL": svc.url, "DMUON_API_TOKEN": svc.token}

    def cli(*args, **extra):
        return subprocess.run([sys.executable, "-m", "service.control.cli", *args],
                              env={**env, **extra}, capture_output=True, text=True,
                              timeout=60)

    submitted = cli("submit", str(spec), "--dry-run", "--follow")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    assert f"{job_id}: SUCCEEDED" in submitted.stdout
    assert "SUCCEEDED" in cli("status", job_id).stdout
    assert json.loads(cli("plan", str(spec), "--json").stdout)["layout"] == {
        "replicate": 2, "shard": 2, "nodes": 1, "tp": 1, "ep": 1,  # what readers had
        "pp": 1, "workers_per_node": 4, "micro_batches": 1, "rows_per_micro": 4,
        "pp_schedule": "1f1b", "pp_stages_per_rank": 1}
    pending = cli("submit", str(spec)).stdout.split()[0]
    assert cli("cancel", pending).stdout.strip() == "STOPPED"
    spec.write_text("model: tiny\nsteps: 0\n")
    bad = cli("submit", str(spec))
    assert bad.returncode == 1 and "steps:" in bad.stderr
    denied = cli("cancel", pending, DMUON_API_TOKEN="wrong")
    assert denied.returncode == 1 and "401" in denied.stderr


def test_the_cli_parses_specs_without_torch(tmp_path):
    code = ("import sys; from service.control.cli import main; "
            "from service.job.spec import load_spec; "
            f"load_spec({str(tmp_path / 'job.yaml')!r}); "
            "print('torch' in sys.modules, 'dmuon' in sys.modules)")
    (tmp_path / "job.yaml").write_text("model: tiny\noptimizer: {adamw_betas: [0.9, 0.99]}\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_strict_json_helper_refuses_nan():
    with pytest.raises(ValueError):
        strict_json("[NaN]")


def test_prometheus_exports_the_newest_step_of_running_jobs(tmp_path):
    from prometheus_client import generate_latest

    from service.control.routes.system import registry_for
    from service.control.step_records import StepRecord, ingest
    from service.control.store import JobStore

    store = JobStore(f"sqlite:///{tmp_path}/db.sqlite")
    try:
        job_id = store.create_job("p", {"name": "p"}, dry_run=False, plan={})[0]["id"]
        store.queue.claim_next(1, "h")
        assert store.queue.mark_submitted(job_id)  # RUNNING
        records = [StepRecord(job_id=job_id, step=step, rank=rank, loss=3.0 - step,
                              tokens_per_s=100.0 + rank, tokens_per_s_total=410.0,
                              mfu=0.25, grad_norm=1.5, lr={"muon": 0.02 * step,
                                                           "adamw": 0.001},
                              val_loss=2.5 if step == 2 else None)
                   for step in (1, 2) for rank in (0, 1)]
        ingest(store, job_id, records, "post")
        text = generate_latest(registry_for(store)).decode()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                      if line.startswith("dmuon_job"))
        label = f'job="{job_id}"'
        assert float(values[f"dmuon_job_step{{{label}}}"]) == 2  # the newest step only
        assert float(values[f"dmuon_job_loss{{{label}}}"]) == 1.0
        assert float(values[f"dmuon_job_val_loss{{{label}}}"]) == 2.5
        assert float(values[f"dmuon_job_tokens_per_s_total{{{label}}}"]) == 410.0
        assert float(values[f'dmuon_job_tokens_per_s{{{label},rank="1"}}']) == 101.0
        assert float(values[f"dmuon_job_mfu{{{label}}}"]) == 0.25
        assert float(values[f"dmuon_job_grad_norm{{{label}}}"]) == 1.5
        assert float(values[f'dmuon_job_lr{{group="muon",{label}}}']) == 0.04
        # a step without validation: the series keeps step 2's value, not a gap
        ingest(store, job_id, [StepRecord(job_id=job_id, step=3, rank=rank, loss=0.5)
                               for rank in (0, 1)], "post")
        text = generate_latest(registry_for(store)).decode()
        values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                      if line.startswith("dmuon_job"))
        assert float(values[f"dmuon_job_step{{{label}}}"]) == 3
        assert float(values[f"dmuon_job_val_loss{{{label}}}"]) == 2.5
    finally:
        store.close()


def test_rays_websocket_closed_lines_stay_off_the_service_console():
    import logging

    import ray.dashboard.modules.job.sdk as sdk

    from service.control.submitter import quiet_ray_sdk

    quiet_ray_sdk()
    assert logging.getLogger(sdk.__name__) is logging.getLogger("ray.dashboard.modules.job.sdk")
    assert not logging.getLogger(sdk.__name__).isEnabledFor(logging.INFO)
    assert logging.getLogger(sdk.__name__).isEnabledFor(logging.WARNING)
