"""``dmuon-svc`` (issue 26, item 7 and item 8's ``mode: auto`` on CPU workers): click
help for every command with the environment it reads; ``--follow``'s start-up phases,
step lines and a failed job's reason; ``plan``'s per-rank tables against the planner's
own numbers; the mode's explanation on CPU workers.

Known values are counted by hand: the tiny preset (vocab 256, dim 64, 2 layers, 4 heads
of 16, 2 KV heads, FFN 128) has 256*64 embedding + 256*64 head + 64 final norm + 2 x
(2*64 norms + 2*64*64 q/o + 2*32*64 k/v + 3*128*64 MLP) = 16384 + 16384 + 64 + 2 * 36992
= 106,816 parameters; the demo's small preset (dim 256, 4 layers, 4 heads of 64, 2 KV
heads, FFN 768) 2*256*256 + 256 + 4 x (512 + 2*65536 + 2*32768 + 589824) = 3,279,104."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys

import click
import pytest
from helpers.service_http import ROOT, Service

from service.control.cli import commands as cli
from service.control.cli.output import failure_line, si
from service.control.cli.progress import Follower, final_line, run_follower

SERVICE_ENV = ("DMUON_URL", "DMUON_API_TOKEN")
COMMANDS = ["submit", "list", "status", "logs", "cancel", "plan", "export", "prepare"]
TINY_PARAMS, SMALL_PARAMS = 106_816, 3_279_104


# -- help --------------------------------------------------------------------------------
def _help(capsys, *argv) -> str:
    assert cli.main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert "`" not in out, out  # no reStructuredText left
    return out


def test_the_root_help_lists_every_command_and_the_environment(capsys):
    out = _help(capsys)
    assert out.startswith("Usage: dmuon-svc [OPTIONS] COMMAND [ARGS]...")
    for command in COMMANDS:
        short = cli.app.commands[command].short_help  # each fits 80 columns whole
        assert short and short.endswith(".") and "..." not in short, command
        assert re.search(rf"^  {command}\s+{re.escape(short)}$", out, re.M), (command, out)
    for name in SERVICE_ENV:
        assert re.search(rf"^ +{name}  +\S", out, re.M), out
    assert "2  a usage error, or a spec file that does not parse" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_helps_every_option_and_names_its_environment(capsys, command):
    out = _help(capsys, command)
    assert out.startswith(f"Usage: dmuon-svc {command} [OPTIONS]")
    params = cli.app.commands[command].params
    for param in params:
        if isinstance(param, click.Option):
            assert param.help and param.help.endswith("."), (command, param.name)
            assert all(opt in out for opt in param.opts), (command, param.opts)
    for name in SERVICE_ENV if command != "prepare" else ("RAY_ADDRESS",):
        assert re.search(rf"^ +{name}  +\S", out, re.M), (command, out)


def test_prepare_takes_every_option_of_the_prepare_module(capsys):
    """One definition: ``python -m service.job.inputs.prepare``'s argparse arguments."""
    import argparse

    from service.job.inputs.prepare import add_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    out = _help(capsys, "prepare")
    wanted = [s for a in parser._actions for s in a.option_strings]
    assert wanted and all(s in out for s in wanted)
    assert "INPUTS: .jsonl or text files" in out


@pytest.mark.parametrize("argv", [[], ["bogus"], ["submit"], ["status", "a", "b"],
                                  ["plan", "x.yaml", "--no-such-option"]])
def test_usage_errors_exit_2(capsys, argv):
    assert cli.main(argv) == 2
    assert "Usage: dmuon-svc" in capsys.readouterr().err


def test_an_unreachable_service_is_exit_1_with_an_error_line(capsys, monkeypatch):
    monkeypatch.setenv("DMUON_URL", "http://127.0.0.1:9")
    assert cli.main(["status"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: cannot reach http://127.0.0.1:9/v1/jobs: ")


# -- a failed job's reason -----------------------------------------------------------------
BOOM = {"id": "dmuon-0123456789ab", "name": "boom-job", "status": "FAILED",
        "reason": {"type": "RuntimeError", "message": "boom\nsecond line", "rank": 2,
                   "step": 3, "phase": "forward",
                   "frames": ["/w/service/worker/loop.py:88 in train_step",
                              "/w/mymodel.py:12 in forward"]}}


@pytest.mark.parametrize("reason,line", [
    (BOOM["reason"], "FAILED: RuntimeError: boom (rank 2, step 3)"),
    ({"type": "ValueError", "message": "bad", "rank": None, "step": 7},
     "FAILED: ValueError: bad (step 7)"),
    ({"type": "WorkerDied", "message": "", "rank": 1, "step": None},
     "FAILED: WorkerDied (rank 1)"),
    ("the worker process died", "FAILED: the worker process died"),
    (None, None),  # a failure the service could not describe
])
def test_the_failure_line(reason, line):
    assert failure_line({**BOOM, "reason": reason}) == line


def test_no_failure_line_without_a_failure_or_from_an_older_server():
    assert failure_line({**BOOM, "status": "SUCCEEDED"}) is None
    assert failure_line({k: v for k, v in BOOM.items() if k != "reason"}) is None


def test_status_prints_the_reason_and_for_one_job_its_frames(capsys, monkeypatch):
    older = {**{k: v for k, v in BOOM.items() if k != "reason"}, "id": "dmuon-old"}
    monkeypatch.setattr(cli, "request", lambda method, path, *a, **k: (
        [BOOM, older] if path == "/v1/jobs" else BOOM))
    assert cli.main(["status"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dmuon-0123456789ab  FAILED     boom-job",
        "  FAILED: RuntimeError: boom (rank 2, step 3)",
        "dmuon-old  FAILED     boom-job"]
    assert cli.main(["status", BOOM["id"]]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "dmuon-0123456789ab  FAILED     boom-job",
        "  FAILED: RuntimeError: boom (rank 2, step 3)",
        "    second line",
        "  last frames (most recent call last):",
        "    /w/service/worker/loop.py:88 in train_step",
        "    /w/mymodel.py:12 in forward"]


# -- --follow --------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _log_lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_follow_names_each_start_up_phase_then_logs_steps_with_the_eta(capsys):
    cli.setup_logging()
    clock = Clock()
    follower = Follower("j", 20, interactive=False, clock=clock)
    follower.on_status({"status": "PENDING"})
    clock.now += 2.4
    follower.on_status({"status": "RUNNING"})
    clock.now += 38
    follower.on_record({"rank": 1, "step": 1, "loss": 9.0})  # only rank 0 moves it
    assert follower.first is None
    follower.on_record({"rank": 0, "step": 1, "loss": 5.5})  # 40.4 s after following
    # 2 s a step; a second record of step 3 (a correction) moves nothing
    for seconds, step, loss in [(2, 2, 5.25), (2, 3, 5.0), (0, 3, 4.0), (2, 4, None),
                                (32, 20, 1.23456)]:
        clock.now += seconds
        follower.on_record({"rank": 0, "step": step, "loss": loss})
    follower.on_status({"status": "SUCCEEDED"})
    assert _log_lines(capsys) == [
        "placing (0 s): queued until the service hands the job to Ray",
        "building (2 s): Ray runs the job: its workers start, build and shard the model, "
        "then run the first step",
        "first step (40 s): step 1, loss 5.5000",
        "step 2/20  loss 5.2500  ETA 36 s",  # 1 step in 2 s, 18 left
        "step 4/20  loss non-finite  ETA 32 s",  # 3 steps in 6 s, 16 left
        "step 20/20  loss 1.2346  ETA 0 s"]
    assert follower.status == "SUCCEEDED" and follower.step == 20


def test_a_job_followed_once_it_runs_has_no_placing_phase(capsys):
    cli.setup_logging()
    follower = Follower("j", 5, interactive=False, clock=Clock())
    follower.on_record({"rank": 0, "step": 3, "loss": 2.0})  # records come before status
    follower.on_status({"status": "RUNNING"})
    assert _log_lines(capsys) == ["first step (0 s): step 3, loss 2.0000"]


def test_follow_shows_the_loss_averaged_over_the_ranks_once_every_rank_reported(capsys):
    """Records that say their layout (2 x 2: four ranks) move the follower once all four
    of a step have come, with their mean, as the dashboard and TensorBoard show it; a
    step a rank never reported is passed over by the next complete one."""
    cli.setup_logging()
    follower = Follower("j", 4, interactive=False, clock=Clock())
    losses = {1: [5.0, 5.5, 6.0, 7.5], 3: [4.0, 4.25, 4.5, 4.75], 4: [1.0, 2.0, 3.0, 4.0]}
    shown_before = {1: 0, 2: 1, 3: 1, 4: 3}  # the last complete step, as a step comes in
    for step in (1, 2, 3, 4):
        for rank in range(4):
            if step == 2 and rank == 3:
                continue  # lost in flight
            loss = losses.get(step, [9.0] * 4)[rank]
            follower.on_record({"rank": rank, "step": step, "loss": loss, "layout": [2, 2]})
            if rank < 3:
                assert follower.step == shown_before[step], (step, rank)
    assert _log_lines(capsys) == [
        "first step (0 s): step 1, loss 6.0000",  # (5 + 5.5 + 6 + 7.5) / 4
        "step 3/4  loss 4.3750  ETA 0 s",  # step 2 never complete; 17.5 / 4
        "step 4/4  loss 2.5000  ETA 0 s"]
    assert follower.pending == {}


def test_on_a_terminal_the_phases_and_steps_are_tqdm_bars(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # tqdm's width when it is no terminal
    cli.setup_logging(logging.WARNING)
    screen = io.StringIO()
    follower = Follower("j", 4, progress=screen, interactive=True)
    events = [("status", {"status": "PENDING"}, None), ("status", {"status": "RUNNING"}, None),
              *[("metrics", {"rank": 0, "step": s, "loss": 3.0 - s / 2}, str(s))
                for s in range(1, 5)],
              ("status", {"status": "SUCCEEDED"}, None)]
    assert run_follower(follower, iter(events)) == "SUCCEEDED"
    text = screen.getvalue()
    assert "] placing: queued for Ray ..." in text
    assert "] building: workers start, build the model, run the first step ..." in text
    final = text.split("\r")[-1]  # the bar as close() leaves it
    assert re.match(r"training: 100%\|\S+\| 4/4 \[", final), final
    assert final.rstrip().endswith("loss 1.0000]"), final


def test_the_final_line_carries_a_failed_jobs_reason():
    assert final_line("j", "SUCCEEDED") == "j: SUCCEEDED"
    assert final_line("j", "FAILED", {"status": "FAILED"}) == "j: FAILED"
    assert final_line("j", "FAILED", BOOM) == "j: FAILED: RuntimeError: boom (rank 2, step 3)"


def _follow_with(monkeypatch, events, job=None):
    import service.control.cli.progress as progress

    asked = []
    monkeypatch.setattr(progress, "job_events", lambda job_id: iter(events))
    monkeypatch.setattr(progress, "request",
                        lambda method, path: asked.append(path) or job)
    out = io.StringIO()
    return progress.follow("j", 5, out=out), out.getvalue(), asked


def test_follow_takes_the_reason_from_the_status_event(monkeypatch, capsys):
    cli.setup_logging()
    failed = {"status": "FAILED", "reason": BOOM["reason"], "message": "Ray's tail"}
    status, out, asked = _follow_with(monkeypatch, [("status", failed, None)])
    assert (status, out, asked) == (
        "FAILED", "j: FAILED: RuntimeError: boom (rank 2, step 3)\n", [])


def test_follow_asks_an_older_server_for_the_job_and_copes_without_a_reason(monkeypatch,
                                                                            capsys):
    cli.setup_logging()
    events = [("status", {"status": "FAILED"}, None)]
    status, out, asked = _follow_with(monkeypatch, events, BOOM)
    assert (status, out, asked) == (
        "FAILED", "j: FAILED: RuntimeError: boom (rank 2, step 3)\n", ["/v1/jobs/j"])
    capsys.readouterr()
    older = {k: v for k, v in BOOM.items() if k != "reason"}
    status, out, asked = _follow_with(monkeypatch, events, older)
    assert (status, out, asked) == ("FAILED", "j: FAILED\n", ["/v1/jobs/j"])
    assert _log_lines(capsys) == ["the job's output: dmuon-svc logs j"]


# -- the mode's explanation on CPU workers ---------------------------------------------------
def test_parameter_counts_read_as_people_write_them():
    from service.job.plan.modes import parameter_count, workers

    assert [parameter_count(n) for n in (640, TINY_PARAMS, 999_950, SMALL_PARAMS,
                                         8_030_261_248, 70_553_706_496)] == [
        "640", "107K", "1M", "3.28M", "8.03B", "70.6B"]
    assert [workers(1, "GPU"), workers(8, "GPU"), workers(4, "CPU"), workers(1, "CPU")] == [
        "1 GPU", "8 GPUs", "4 CPU workers", "1 CPU worker"]


def _cpu_plan(data: dict, workers: int):
    from service.job.plan.inventory import synthetic_inventory
    from service.job.plan.predict import predict
    from service.job.spec import parse_spec

    return predict(parse_spec(data), synthetic_inventory(1, 0, cpus_per_node=workers))


def test_auto_on_cpu_workers_names_them_and_the_real_parameter_count():
    from service.dev.demo import DEFAULT_JOB

    placement = _cpu_plan({**DEFAULT_JOB, "dmuon": {"mode": "auto"}}, 4)  # make demo's job
    assert placement.modes.params == SMALL_PARAMS
    assert placement.modes.reason == ("chosen by dmuon.mode: auto: 3.28M parameters on 4 "
                                      "CPU workers (< 8): Z3")
    wide = _cpu_plan({"model": "tiny", "layout": {"replicate": 2, "shard": 4},
                      "dmuon": {"mode": "auto", "device_memory_gb": 16.0}}, 8)
    resident = wide.plan.total_elements * 4  # float32 compute: 4 bytes per element
    assert wide.modes.dmuon == "z2" and wide.modes.resident_pm_bytes == resident
    free = 0.9 * 16e9 - wide.modes.z3_bytes
    assert wide.modes.reason == (
        f"chosen by dmuon.mode: auto: 107K parameters (< 3B) on 8 CPU workers (>= 8): Z2, "
        f"its resident P_M {resident / 1e6:.2f} MB fits in the {free / 1e9:.1f} GB Z3 leaves free")


def test_a_cpu_worker_that_cannot_hold_z3_is_named_as_such():
    from service.job.plan.modes import decide
    from service.job.spec.recipe_section import DMuonSpec

    choice = decide(DMuonSpec(mode="auto"), params=TINY_PARAMS, gpus=4, shard=4,
                    device_bytes=int(1e9), z2_bytes=int(3e9), z3_bytes=int(2e9),
                    resident_pm=1000, device="CPU")
    assert choice.reason.startswith("chosen by dmuon.mode: auto: even Z3 needs 2.0 GB of a "
                                    "CPU worker's 1 GB: it does not fit")
    gpu = decide(DMuonSpec(mode="auto"), params=TINY_PARAMS, gpus=4, shard=4,
                 device_bytes=int(80e9), z2_bytes=int(3e9), z3_bytes=int(2e9),
                 resident_pm=1000)
    assert gpu.reason == "chosen by dmuon.mode: auto: 107K parameters on 4 GPUs (< 8): Z3"


# -- against a real control plane (uvicorn, SQLite, no Ray) ----------------------------------
PLANNED = {"name": "plan-me", "model": "tiny", "steps": 5, "batch_size": 2, "seq_len": 16,
           "layout": {"replicate": 2, "shard": 2}, "clip_grad_norm": 1.0,
           "dmuon": {"mode": "auto"}}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    service = Service(str(tmp_path_factory.mktemp("cli")), DMUON_LOCAL_RAY="0")
    yield service
    service.kill()


def _env(svc) -> dict:
    return {**os.environ, "DMUON_URL": svc.url, "DMUON_API_TOKEN": svc.token}


def _cli(svc, *args):
    return subprocess.run([sys.executable, "-m", "service.control.cli", *args], cwd=ROOT,
                          env=_env(svc), capture_output=True, text=True, timeout=120)


UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1}


def _close(cell: str, want: float, units=UNITS) -> None:
    """``cell`` is ``want`` to the digits it shows (half a unit of its last digit)."""
    number, unit = cell.split(" ")
    if units is not TIME_UNITS:
        unit = unit.removesuffix("FLOP") if unit.endswith("FLOP") else unit.removesuffix("B")
    scale = units[unit]
    digits = len(number.split(".")[1]) if "." in number else 0
    assert abs(float(number) * scale - want) <= 0.5 * 10 ** -digits * scale * (1 + 1e-9), (
        cell, want)


def _table(lines: list[str], title: str, rows: int) -> list[list[str]]:
    start = lines.index(title) + 1
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start:start + 1 + rows]]


def test_plan_prints_the_planners_per_rank_predictions(svc, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(PLANNED))
    proc = _cli(svc, "plan", str(spec))
    assert proc.returncode == 0, proc.stderr
    placement = _cpu_plan(PLANNED, 4)  # the service plans on 1 assumed node of 4 CPUs
    lines = proc.stdout.splitlines()
    muon = sum(p.numel for p in placement.plan.params.values())
    assert lines[:5] == [
        "layout 2 x 2 (replicate x shard) on 1 node: 4 CPU workers",
        "planned on 1 assumed node of 4 CPUs (no Ray cluster attached)",
        "mode Z3 (FSDP2 Z3): chosen by dmuon.mode: auto: 107K parameters on 4 CPU workers "
        "(< 8): Z3",
        f"one rank needs Z2 {si(placement.modes.z2_bytes, 'B')}, Z3 "
        f"{si(placement.modes.z3_bytes, 'B')} of 16.00 GB (fits)",
        f"Muon: {len(placement.split['muon'])} params, {muon:,} elements (P_M), imbalance "
        f"{placement.plan.imbalance:.4f}; AdamW: {len(placement.split['adamw'])} params"]
    kinds = list(placement.ranks[0].memory)
    memory = _table(lines, "held per rank after a step (packed peak: during one)", 4)
    assert memory[0] == ["rank", "(r,s)", "Muon elements", "NS FLOP/step",
                         *(k.replace("_", " ") for k in kinds), "packed peak"]
    for row, rank in zip(memory[1:], placement.ranks, strict=True):
        assert row[:3] == [str(rank.rank), "({},{})".format(*rank.coord),
                           f"{rank.owned_elements:,}"]
        for cell, want in zip(row[3:], [rank.ns_flops, *(rank.memory[k] for k in kinds),
                                        rank.packed_peak], strict=True):
            _close(cell, want)
    keys = [(d, p) for d, phases in placement.ranks[0].ledger.items() for p in phases]
    traffic = _table(lines, "bytes per step per rank, by mesh dim and phase", 4)
    assert traffic[0] == ["rank", *(f"{d} {p}" for d, p in keys), "comm time"]
    for row, rank in zip(traffic[1:], placement.ranks, strict=True):
        assert row[0] == str(rank.rank)
        for cell, (d, p) in zip(row[1:-1], keys, strict=True):
            _close(cell, rank.ledger[d][p])
        _close(row[-1], rank.comm_seconds, TIME_UNITS)
    assert len(lines) == 5 + 2 + 5 + 2 + 5  # nothing else


def test_plan_shows_the_ep_degree_and_each_ranks_ep_coordinate(svc, tmp_path):
    """Experts over EP 2 on 1 x 4: the EP group is 2 consecutive shard ranks, so the
    ranks' EP coordinates are 0, 1, 0, 1."""
    spec = {"model": "small-moe", "steps": 2, "layout": {"replicate": 1, "shard": 4, "ep": 2}}
    proc = _cli(svc, "plan", _spec_file(tmp_path, "job.json", spec))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == ("layout 1 x 4, ep 2 (replicate x shard; experts over ep) on 1 node: "
                        "4 CPU workers")
    memory = _table(lines, "held per rank after a step (packed peak: during one)", 4)
    assert memory[0][:3] == ["rank", "(r,s)", "ep"]
    assert [row[2] for row in memory[1:]] == ["0", "1", "0", "1"]
    traffic = _table(lines, "bytes per step per rank, by mesh dim and phase", 4)
    assert {"ep forward", "ep backward"} <= set(traffic[0])


def test_plan_json_is_the_plan_document(svc, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(PLANNED))  # JSON is YAML
    proc = _cli(svc, "plan", str(spec), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    placement = _cpu_plan(PLANNED, 4)
    mesh = {"replicate": 2, "shard": 2, "nodes": 1, "tp": 1, "ep": 1, "pp": 1}
    assert {k: doc["layout"][k] for k in mesh} == mesh
    assert doc["ranks"] == json.loads(json.dumps([r.__dict__ for r in placement.ranks]))
    assert doc["modes"] == placement.modes.to_dict()


def test_follow_shows_placing_while_queued_and_ends_with_the_status(svc, tmp_path):
    """Without Ray the job stays queued: the CLI says so within its first status event;
    a cancel ends the stream with STOPPED (exit 1: the job did not succeed)."""
    spec = tmp_path / "job.yaml"
    spec.write_text("name: queued\nmodel: tiny\nsteps: 5\nlayout: {replicate: 2, shard: 2}\n")
    proc = subprocess.Popen([sys.executable, "-m", "service.control.cli", "submit", str(spec),
                             "--follow"], cwd=ROOT, env=_env(svc), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        job_id = proc.stdout.readline().strip()
        first = proc.stderr.readline()  # stderr is no terminal: log lines, no bars
        assert re.fullmatch(r"placing \(\d+ s\): queued until the service hands the job to "
                            r"Ray\n", first), first
        assert svc.request("POST", f"/v1/jobs/{job_id}/cancel")[1]["status"] == "STOPPED"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, out, err) == (1, f"{job_id}: STOPPED\n", "")
    status = _cli(svc, "status", job_id)
    assert status.stdout == f"{job_id}  STOPPED    queued\n"


# -- issue 43, items 7-9: refusals as lines, where the mode came from, list ----------------
def _spec_file(tmp_path, name: str, spec: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.mark.parametrize("command", ["plan", "submit"])
def test_a_refusal_prints_each_field_and_message_on_a_line(svc, tmp_path, command):
    """tp 3 on the service's one assumed node of 4 CPUs: refused naming spec.layout.tp,
    printed as that line, not as the service's JSON."""
    spec = _spec_file(tmp_path, "tp3.json", {"model": "tiny", "steps": 2,
                                             "layout": {"shard": 2, "tp": 3}})
    proc = _cli(svc, command, spec)
    assert (proc.returncode, proc.stdout) == (1, ""), proc
    lines = proc.stderr.splitlines()
    assert lines[0] == "error: the service refused the request (422 Unprocessable Entity):"
    assert len(lines) == 2 and lines[1].startswith(
        "  spec.layout.tp: layout.tp=3 must divide the 4 workers per node"), lines
    assert "{" not in proc.stderr and "detail" not in proc.stderr


def test_an_error_with_a_message_prints_the_message():
    from service.control.cli.http import refusal

    assert refusal(404, "Not Found", '{"detail": "no job \'dmuon-x\'"}') == (
        "404 Not Found: no job 'dmuon-x'")
    assert refusal(502, "Bad Gateway", "<html>proxy</html>") == (
        "502 Bad Gateway: <html>proxy</html>")
    assert refusal(422, "Unprocessable Entity", json.dumps({"detail": [
        {"field": "spec.steps", "message": "must be >= 1"},
        {"field": "query.tail", "message": "too long"}]})).splitlines() == [
        "the service refused the request (422 Unprocessable Entity):",
        "  spec.steps: must be >= 1", "  query.tail: too long"]


@pytest.mark.parametrize("dmuon, line", [
    (None, "mode Z3 (FSDP2 Z3): the default: the spec sets no dmuon.mode (z3; dmuon.mode: "
           "auto lets the planner choose)"),
    ({"device_memory_gb": 16.0}, "mode Z3 (FSDP2 Z3): the default: the spec sets no "
                                 "dmuon.mode (z3; dmuon.mode: auto lets the planner choose)"),
    ({"mode": "z3"}, "mode Z3 (FSDP2 Z3): set by the spec (dmuon.mode: z3)"),
    ({"mode": "z2"}, "mode Z2 (FSDP2 Z2): set by the spec (dmuon.mode: z2)"),
    ({"mode": "auto"}, "mode Z3 (FSDP2 Z3): chosen by dmuon.mode: auto: 107K parameters on "
                       "4 CPU workers (< 8): Z3"),
], ids=["no-dmuon-section", "no-mode", "z3", "z2", "auto"])
def test_plan_says_where_the_mode_came_from(svc, tmp_path, dmuon, line):
    spec = {"model": "tiny", "steps": 2, **({"dmuon": dmuon} if dmuon else {})}
    proc = _cli(svc, "plan", _spec_file(tmp_path, "job.json", spec))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[2] == line, proc.stdout


def test_list_shows_the_jobs_as_the_service_lists_them(svc, tmp_path):
    from service.control.sql_tables import STATES

    assert cli.STATES == STATES  # the CLI does not import the store's tables
    for name in ("listed-a", "listed-b"):
        spec = _spec_file(tmp_path, f"{name}.json", {"name": name, "model": "tiny", "steps": 2})
        assert _cli(svc, "submit", spec).returncode == 0
    stopped = svc.request("POST", "/v1/jobs", {"spec": {"name": "listed-c", "steps": 2}})[1]
    svc.request("POST", f"/v1/jobs/{stopped['id']}/cancel")
    jobs = svc.request("GET", "/v1/jobs")[1]
    want = [f"{j['id']}  {j['status']:<9}  {j['name']}" for j in jobs]
    listed = _cli(svc, "list")
    assert listed.returncode == 0 and listed.stdout.splitlines() == want, listed
    assert _cli(svc, "status").stdout == listed.stdout  # status without a job id, as before
    only = _cli(svc, "list", "--status", "STOPPED", "--limit", "1").stdout.splitlines()
    assert only == [next(line for line in want if "STOPPED" in line)]
    assert only == [f"{stopped['id']}  STOPPED    listed-c"]
    as_json = json.loads(_cli(svc, "list", "--json").stdout)
    assert as_json == svc.request("GET", "/v1/jobs")[1]
    assert _cli(svc, "list", "--status", "DONE").returncode == 2





def test_status_of_a_finished_job_shows_its_final_loss_and_val_loss(svc, tmp_path):
    """The newest step's loss (mean over its 2 ranks) and the newest validation loss,
    which came two steps earlier."""
    status, job = svc.request("POST", "/v1/jobs", {"spec": PLANNED, "dry_run": True})
    assert status == 201, job
    records = [{"job_id": job["id"], "step": step, "rank": rank, "loss": 3.0 - step + rank,
                "val_loss": 2.5 if step == 2 and rank == 0 else None}
               for step in (1, 2, 3, 4) for rank in (0, 1)]
    status, _ = svc.request("POST", f"/v1/jobs/{job['id']}/metrics", records)
    assert status == 200
    proc = _cli(svc, "status", job["id"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1] == ("  loss -0.5000 at step 4 (mean of the ranks)  "
                                           "val_loss 2.5000 at step 2"), proc.stdout
