"""End to end: real uvicorn on 127.0.0.1 starting its own local Ray head, jobs through
Ray's job API, the dashboard in Debian's Chromium (no MFU axis on CPUs, the log view, a
job sent with the real `ray job submit` that registers itself and is listed, its
building state, one colour per memory kind, cancel from the page), a SIGKILLed service
restarting, a head kept over Ctrl-C (``--keep-ray``) and one stopped by SIGTERM, and a
job's log as ``dmuon-svc logs`` prints it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest
from helpers.browser import ARTIFACTS, page_with_errors
from helpers.paths import TESTS
from helpers.service_http import Service, alive, head_processes

from service.control.ray_head import STATE_FILE
from service.job.failure import strip_ansi

SPEC = {"name": "e2e", "model": "tiny", "steps": 16, "batch_size": 2, "seq_len": 32,
        "layout": {"replicate": 2, "shard": 2}, "data": {"val_every": 0}}
WORLD = 4
FAULTS = os.path.join(TESTS, "helpers", "faults.py")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("e2e with a space"))  # Ray runs the command in a shell
    # RAY_ADDRESS unset: the service starts its own head
    holds = os.path.join(root, "holds")  # a job's ranks wait before step s while
    os.makedirs(holds)                      # holds/step_<s> exists
    wrapper = [sys.executable, FAULTS, "serve", f"hold:{holds}", "--"]
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


@contextlib.contextmanager
def _dashboard(svc, path="/"):
    """The page with the admin token (cancel and the log view need it), failing on any
    console error or failed request it made."""
    with page_with_errors() as (page, errors):
        page.add_init_script(f"localStorage.setItem('dmuonToken', {json.dumps(svc.token)})")
        page.goto(svc.url + path)
        yield page
        assert errors == []


def _memory_colours(page) -> dict:
    """{kind: the colour Plotly drew it in} of the memory chart's bars as it stands (not
    the markers of each rank's peak within the step, which the prediction has not)."""
    return dict(page.evaluate("document.getElementById('memory-chart')._fullData"
                              ".filter(t => t.type === 'bar')"
                              ".map(t => [t.name, t.marker.color])"))


def _watch_dashboard(page, svc, job_id, held_step) -> dict:
    """The page while the job runs (held before ``held_step`` until the page shows every
    step before it): one bar per rank for ownership and memory, a loss chart that
    gains points, no MFU axis (a CPU job has no MFU); a screenshot for people to look
    at. Returns the measured memory chart's colours."""
    page.wait_for_function(f"document.getElementById('loss-chart').data?.[0]?.x.length "
                           f"== {held_step - 1}", timeout=180_000)
    seen = _points(page)
    assert svc.request("GET", f"/v1/jobs/{job_id}")[1]["status"] == "RUNNING"
    os.remove(os.path.join(svc.holds, f"step_{held_step}"))
    page.wait_for_function(f"document.getElementById('loss-chart').data[0].x.length > "
                           f"{seen}", timeout=60_000)
    assert page.locator("#ownership-chart .barlayer .point").count() == WORLD
    assert "planned on\nthe cluster's 1 node" in page.locator("#job-facts").inner_text()
    # the bars (the markers beside them are each rank's peak within the step)
    memory = page.evaluate("document.getElementById('memory-chart').data"
                           ".filter(t => t.type === 'bar').map(t => new Set(t.x).size)")
    assert memory and all(n == WORLD for n in memory)  # stacked kinds, a bar per rank
    assert page.locator("#memory-chart .barlayer .trace").count() == len(memory)
    assert page.locator("#memory-caption").inner_text().startswith(
        "Memory per rank by kind (measured at step")
    assert all(r["mfu"] is None for r in svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1])
    throughput = page.evaluate("(() => { const gd = document.getElementById("
                               "'throughput-chart'); return [gd.data.map(t => t.name), "
                               "'yaxis2' in gd.layout, gd.querySelectorAll('.y2tick')"
                               ".length, gd.querySelectorAll('.ytick').length]; })()")
    assert throughput[:3] == [["tokens/s (all ranks)"], False, 0] and throughput[3] > 0
    assert page.locator("#throughput-caption").inner_text() == \
        "Throughput: tokens/s of all ranks"
    os.makedirs(ARTIFACTS, exist_ok=True)
    page.screenshot(path=os.path.join(ARTIFACTS, "dashboard.png"), full_page=True)
    return _memory_colours(page)


def _log_view_shows_the_tail(page, svc, job_id) -> None:
    """The open log view holds the driver's log's last lines as ``GET .../logs`` has it
    whole (escape codes aside), the entrypoint's summary near the end (Ray's own
    lines may follow it)."""
    page.locator("#log-view summary").click()
    page.wait_for_function("document.getElementById('job-log').textContent"
                           ".includes('\"summary\"')", timeout=60_000)
    whole = svc.request("GET", f"/v1/jobs/{job_id}/logs")[1]
    lines = strip_ansi(whole).rstrip("\n").split("\n")
    shown = page.evaluate("document.getElementById('job-log').textContent").split("\n")
    assert shown == lines[-200:] and any('"summary"' in line for line in shown[-20:])
    assert svc.request("GET", f"/v1/jobs/{job_id}/logs?tail=3")[1] == \
        "".join(line + "\n" for line in whole.rstrip("\n").split("\n")[-3:])


def _send_with_ray_job_submit(svc, folder) -> str:
    """The real ``ray job submit`` CLI against the service's head, with DMUON_URL and the
    token in the job's env; its entrypoint runs under tests/helpers/faults.py's holds (which
    calls the entrypoint's ``main`` as it is). The submission id, once its entrypoint
    has registered it."""
    spec = os.path.join(folder, "by-ray.json")
    with open(spec, "w") as fh:
        json.dump({**SPEC, "name": "by-ray", "steps": 200}, fh)
    submission = f"raysubmit-{os.getpid()}-{int(time.time())}"
    env = {"env_vars": {"DMUON_URL": svc.url, "DMUON_API_TOKEN": svc.token}}
    sent = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit", "--no-wait",
         "--address", f"http://127.0.0.1:{_head(svc)['dashboard_port']}", "--submission-id",
         submission, "--runtime-env-json", json.dumps(env), "--", sys.executable, FAULTS,
         "entrypoint", f"hold:{svc.holds}", "--", "--spec", spec],
        capture_output=True, text=True, timeout=120)
    assert sent.returncode == 0, sent.stdout + sent.stderr
    deadline = time.time() + 120
    while svc.request("GET", f"/v1/jobs/{submission}")[0] == 404 and time.time() < deadline:
        time.sleep(0.5)
    status, job = svc.request("GET", f"/v1/jobs/{submission}")
    assert status == 200, f"{submission} never registered: {status} {job}"
    assert (job["status"], job["name"], job["spec"]["steps"]) == ("RUNNING", "by-ray", 200)
    assert job["history"][0]["message"] == "registered by its entrypoint (ray job submit)"
    again = svc.request("POST", "/v1/jobs/register", {"spec": job["spec"],
                                                      "submission_id": submission})
    assert again[0] == 409 and submission in again[1]["detail"]
    return submission


def _building_then_cancel(page, svc, job_id, measured: dict) -> None:
    """The registered job is listed; held before its first step, the page says it is
    building, its metric charts draw no axes, its memory chart (the prediction) has the
    measured chart's colours per kind. Released, its first step's records (posted with
    the job token its registration got) reach the page; then the page's cancel button
    stops it, on Ray too."""
    row = page.locator(f"#jobs tbody tr[data-id='{job_id}']")
    row.wait_for(timeout=30_000)
    row.click()
    page.wait_for_function("document.getElementById('job-phase').dataset.phase "
                           "=== 'building'", timeout=60_000)
    assert svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1] == []  # held: no record
    assert page.locator("#job-phase").inner_text().startswith("building (")
    charts = page.evaluate("['loss-chart', 'throughput-chart', 'steptime-chart'].map(id => {"
                           "const gd = document.getElementById(id); return [gd.data.length,"
                           " gd.layout.annotations[0].text, gd.querySelectorAll('.xtick, "
                           ".ytick').length]; })")
    assert charts == [[0, "waiting for the first step", 0]] * 3
    assert page.locator("#memory-caption").inner_text().endswith("(predicted by the planner)")
    predicted = _memory_colours(page)
    assert predicted == measured and len(set(measured.values())) == len(measured)
    page.screenshot(path=os.path.join(ARTIFACTS, "dashboard-building.png"), full_page=True)
    os.remove(os.path.join(svc.holds, "step_1"))  # on to step 1; held before step 2
    page.wait_for_function("document.getElementById('loss-chart').data?.[0]?.x.length "
                           "=== 1", timeout=120_000)
    assert page.locator("#job-phase").is_hidden()
    keys = [(m["step"], m["rank"]) for m in svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1]]
    assert keys == [(1, r) for r in range(WORLD)]
    part = svc.request("GET", f"/v1/jobs/{job_id}/partition")[1]
    assert part["inventory"] == {"source": "cluster", "nodes": 1} and len(part["ranks"]) == WORLD
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#cancel-job").click()
    page.wait_for_function("document.getElementById('job-title').dataset.status "
                           "=== 'STOPPED'", timeout=30_000)
    assert svc.request("GET", f"/v1/jobs/{job_id}")[1]["status"] == "STOPPED"
    assert page.locator("#cancel-job").is_hidden()
    from ray.job_submission import JobStatus, JobSubmissionClient

    ray_jobs = JobSubmissionClient(f"http://127.0.0.1:{_head(svc)['dashboard_port']}")
    deadline = time.time() + 60
    while ray_jobs.get_job_status(job_id) != JobStatus.STOPPED and time.time() < deadline:
        time.sleep(0.5)
    assert ray_jobs.get_job_status(job_id) == JobStatus.STOPPED
    logs = svc.request("GET", f"/v1/jobs/{job_id}/logs")[1]  # Ray's log, through the service
    assert f"registered as job {job_id} with the control plane at {svc.url}" in logs


def test_submit_watch_dashboard_follow_events_to_success_and_cancel_another(stack,
                                                                              tmp_path):
    svc = stack
    open(os.path.join(svc.holds, "step_3"), "w").close()
    # this job's blocks run under torch.compile (inductor); tests/core/test_compile.py holds
    # compiled runs to eager ones
    status, job = svc.request("POST", "/v1/jobs", {"spec": {**SPEC, "compile": True}})
    assert status == 201 and job["status"] == "PENDING"
    assert job["spec"]["compile"]["enabled"] is True
    holds = [os.path.join(svc.holds, f"step_{s}") for s in (1, 2)]
    try:
        with _dashboard(svc, f"/#job={job['id']}") as page:
            measured = _watch_dashboard(page, svc, job["id"], held_step=3)
            _first_job_to_success(svc, job)
            _log_view_shows_the_tail(page, svc, job["id"])
            for hold in holds:  # the next job waits before its first and second steps
                open(hold, "w").close()
            _building_then_cancel(page, svc, _send_with_ray_job_submit(svc, tmp_path),
                                  measured)
    finally:
        for hold in holds:
            with contextlib.suppress(FileNotFoundError):
                os.remove(hold)
    status, logs = svc.request("GET", f"/v1/jobs/{job['id']}/logs")
    summary = json.loads(next(line for line in logs.splitlines() if '"summary"' in line))
    assert status == 200 and summary["summary"]["final_step"] == SPEC["steps"]
    assert svc.request("GET", f"/v1/jobs/{job['id']}/logs", token=False)[0] == 401
    from ray.job_submission import JobSubmissionClient

    dashboard = f"http://127.0.0.1:{_head(svc)['dashboard_port']}"
    info = JobSubmissionClient(dashboard).get_job_info(job["id"])
    assert svc.token not in json.dumps(info.dict(), default=str)  # no admin token in Ray
    streamed = subprocess.run(  # logs -f streams ?follow=true, which ends with the job
        [sys.executable, "-m", "service.control.cli", "logs", "-f", job["id"]], capture_output=True,
        text=True, timeout=120, env={**os.environ, "DMUON_URL": svc.url,
                                      "DMUON_API_TOKEN": svc.token})
    assert streamed.returncode == 0 and '"summary"' in streamed.stdout, streamed.stderr


def _first_job_to_success(svc, job) -> None:
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


RESTARTED: dict = {}  # the job the SIGKILL test leaves held for the next test


def test_sigkill_restart_reattaches_keeps_jobs_and_metrics_and_reconciles(stack):
    svc = stack
    head = _head(svc)
    hold = os.path.join(svc.holds, "step_12")  # released by the next test
    open(hold, "w").close()
    _, job = svc.request("POST", "/v1/jobs", {"spec": {**SPEC, "steps": 20}})
    deadline = time.time() + 240
    while time.time() < deadline and len(svc.request(
            "GET", f"/v1/jobs/{job['id']}/metrics")[1]) < WORLD * 3:
        time.sleep(0.3)
    before = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert len(before) >= WORLD * 3
    svc.kill()  # SIGKILL while the job runs; its posts fail meanwhile, its spool goes on
    time.sleep(3)
    svc.start("--keep-ray", stderr=os.path.join(svc.root, "kept.stderr"))  # for the next test
    assert _head(svc) == head  # re-attached to the same head, not a new one
    assert svc.request("GET", f"/v1/jobs/{job['id']}")[1]["status"] == "RUNNING"
    held = [(s, r) for s in range(1, 12) for r in range(WORLD)]  # steps 1-11, before the hold
    deadline = time.time() + 120
    while len(keys := _keys(svc, job["id"])) < len(held) and time.time() < deadline:
        time.sleep(0.3)
    assert keys == held  # none lost, no duplicates
    RESTARTED.update(job=job["id"], before=before, hold=hold)


def _keys(svc, job_id) -> list[tuple[int, int]]:
    return [(m["step"], m["rank"]) for m in svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1]]


def _stderr(path: str) -> str:
    with open(path, errors="replace") as fh:
        return fh.read()


def test_a_kept_head_outlives_sigint_and_the_next_service_finishes_its_job(stack,
                                                                         monkeypatch,
                                                                         capsys):
    """``--keep-ray`` and Ctrl-C: exit 0, no traceback, the head and its held job go on;
    a service without the flag re-attaches, the job ends SUCCEEDED, its log reads as a
    line per step, ``--follow`` shows the mean loss over the ranks; then SIGTERM stops
    the service and every process of the head."""
    from ray.job_submission import JobSubmissionClient

    svc, job_id = stack, RESTARTED["job"]
    head = _head(svc)
    assert svc.signalled(signal.SIGINT) == 0
    err = _stderr(os.path.join(svc.root, "kept.stderr"))
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert alive({head["pid"]}) == {head["pid"]}
    ray_jobs = JobSubmissionClient(f"http://127.0.0.1:{head['dashboard_port']}")
    assert str(ray_jobs.get_job_status(job_id).value) == "RUNNING"  # held, on the kept head
    second = os.path.join(svc.root, "second.stderr")
    svc.start(stderr=second)
    assert _head(svc) == head  # re-attached
    os.remove(RESTARTED["hold"])
    assert svc.wait_ended(job_id)["status"] == "SUCCEEDED"
    after = svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1]
    assert [(m["step"], m["rank"]) for m in after] == [
        (s, r) for s in range(1, 21) for r in range(WORLD)]
    assert all(m in after for m in RESTARTED["before"])
    means = {s: statistics.fmean(m["loss"] for m in after if m["step"] == s)
             for s in range(1, 21)}
    _the_log_reads_as_a_line_per_step(svc, job_id, means)
    _follow_shows_the_mean_loss(svc, job_id, means, monkeypatch, capsys)
    processes = head_processes(head)
    assert head["pid"] in processes and len(processes) > 5
    assert svc.signalled(signal.SIGTERM) == 0
    err = _stderr(second)
    assert "Traceback" not in err, err[-3000:]
    assert alive(processes) == set()
    assert not os.path.exists(os.path.join(svc.env["DMUON_STORAGE"], STATE_FILE))


def _cli(svc, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.control.cli", *args], capture_output=True,
                          timeout=120, env={**os.environ, "DMUON_URL": svc.url,
                                            "DMUON_API_TOKEN": svc.token})


def _the_log_reads_as_a_line_per_step(svc, job_id, means) -> None:
    """``dmuon-svc logs`` into a pipe: at most 2 lines per step, no escape byte, one line
    per step with the mean loss (counted here from the stored records); ``--raw`` is
    the log as Ray keeps it."""
    shown = _cli(svc, "logs", job_id)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout.decode()
    lines = text.splitlines()
    assert b"\x1b" not in shown.stdout and len(lines) <= 2 * len(means), text
    steps = [re.search(r"step (\d+)  loss (\S+) \(mean of 4 ranks\)", line) for line in lines]
    assert [(int(m[1]), m[2]) for m in steps if m] == [
        (s, f"{loss:.4f}") for s, loss in means.items()], text
    assert '"summary"' in lines[-1]
    raw = _cli(svc, "logs", "--raw", job_id)
    assert raw.stdout.decode() == svc.request("GET", f"/v1/jobs/{job_id}/logs")[1]


def _follow_shows_the_mean_loss(svc, job_id, means, monkeypatch, capsys) -> None:
    """The follower on the ended job's whole event stream: each step line's loss is the
    mean over the ranks."""
    from service.control.cli import commands as cli
    from service.control.cli.progress import follow

    monkeypatch.setenv("DMUON_URL", svc.url)
    monkeypatch.setenv("DMUON_API_TOKEN", svc.token)
    capsys.readouterr()
    cli.setup_logging()
    out = io.StringIO()
    assert follow(job_id, 20, out=out, progress=io.StringIO()) == "SUCCEEDED"
    shown = re.findall(r"step (\d+)(?:/20|,)  ?loss (\S+)", capsys.readouterr().err)
    assert len(shown) >= 10, shown  # the first step, then one line per two steps
    assert all(loss == f"{means[int(step)]:.4f}" for step, loss in shown), shown
