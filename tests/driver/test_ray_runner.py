"""The Ray Train runner on real Ray: a local head on 127.0.0.1 (our own process group) and
a simulated 2-node cluster; TorchTrainer, fault recovery and ``ray job submit``. The jobs
read token shards that ``dmuon-svc prepare`` made from a JSONL corpus (the standard
library's sources) with a byte-level BPE tokenizer this module trains. The baseline job
also logs to a real ``mlflow server`` and to an offline W&B run, read back next to a real
``tensorboard`` process's HTTP API."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers.faults import installed
from helpers.paths import ROOT
from helpers.tensorboard_events import TensorBoard, event_files, scalars
from helpers.tracking import MlflowServer, mlflow_run, wandb_run

from service.control.ray_head import RAY, LocalRayHead
from service.job.spec import parse_spec

SPEC = {"name": "t", "model": "tiny", "steps": 8, "batch_size": 4, "seq_len": 32,
        "layout": {"replicate": 2, "shard": 2}, "checkpoint": {"interval": 4},
        "data": {"val_every": 4, "source": "shards/train_*.bin",
                 "val_source": "shards/val_*.bin"}, "max_failures": 1,
        "schedule": {"decay": "constant"},  # the learning bound below predates schedules
        "optimizer": {"adamw_lr": 3e-3}}  # the spec's default before it became Muon's 1e-3


def _tokenizer(path: str, docs: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<|endoftext|>"], initial_alphabet=[]))
    tok.save(path)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """Token shards under a data root, made by ``dmuon-svc prepare`` (a subprocess)."""
    import pathlib
    import sysconfig

    root = tmp_path_factory.mktemp("data")
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:80]
    docs = [p.read_text(errors="replace") for p in files]
    with open(root / "corpus.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    _tokenizer(str(root / "tokenizer.json"), docs)
    proc = subprocess.run(
        [sys.executable, "-m", "service.control.cli", "prepare", "--tokenizer",
         str(root / "tokenizer.json"), "--out", str(root / "shards"), "--shard-tokens",
         "50000", str(root / "corpus.jsonl")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return str(root)


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


def _tensorboard_loss(storage, job_id):
    """(step, loss) from the job's event file, and the mean loss of the first complete
    set of records of each step in the spool (float32, as TensorBoard keeps scalars)."""
    got = scalars(os.path.join(storage, job_id, "tensorboard"))
    first: dict[int, dict[int, float]] = {}
    for rec in _records(storage, job_id):
        first.setdefault(rec["step"], {}).setdefault(rec["rank"], rec["loss"])
    expect = [(s, float(np.float32(np.mean(list(first[s].values()))))) for s in sorted(first)]
    return [(s, v) for s, v, _ in got["loss"]], expect


def _run(storage, data_root, job_id, fault=None, spec=SPEC):
    from service.driver.job_driver import run_job
    from service.job.inputs import resolve_inputs

    params = os.path.join(storage, f"{job_id}.params.pt")
    spec = parse_spec(spec)
    inputs = resolve_inputs(spec, data_root)
    assert len(inputs["data"]["train"]) > 1  # several shards, memory-mapped
    with installed(fault) if fault else contextlib.nullcontext():
        run_job(spec, job_id=job_id, storage=storage, return_params=params, inputs=inputs)
    return _records(storage, job_id), torch.load(params)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """Started here, waited for by the baseline: it boots while Ray's head does."""
    server = MlflowServer(str(tmp_path_factory.mktemp("mlflow")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def baseline(mlflow_server, head, storage, data_root):
    metrics = {"mlflow": {"tracking_uri": mlflow_server.wait().url},
               "wandb": {"mode": "offline"}}
    return _run(storage, data_root, "baseline", spec={**SPEC, "metrics": metrics})


def test_trainer_learns_and_reports_every_rank(baseline, storage):
    records, _ = baseline
    steps = sorted({r["step"] for r in records})
    assert steps == list(range(1, 9))
    for step in steps:
        assert sorted(r["rank"] for r in records if r["step"] == step) == [0, 1, 2, 3]
    val = [r["val_loss"] for r in records if r["step"] == 8]
    # the untrained model predicts about uniformly: log(256) = 5.55 nats per token. BPE
    # tokens carry more than bytes did (the bound was log(256) - 1 on bytes): measured
    # 5.15 after 8 steps, 0.40 below uniform
    assert val and val[0] <= math.log(256) - 0.3, val
    coords = {r["rank"]: tuple(r["coord"]) for r in records}
    assert coords == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    got, expect = _tensorboard_loss(storage, "baseline")  # the controller's event file
    assert got == expect and [s for s, _ in got] == steps
    # each rank kept its record of every step, once: the very record the controller
    # spooled
    kept = {}
    for path in glob.glob(os.path.join(storage, "baseline", "rank_records", "*")):
        with open(path) as fh:
            for r in map(json.loads, fh):
                assert kept.setdefault((r["step"], r["rank"]), r) is r
    spooled = {(r["step"], r["rank"]): {k: v for k, v in r.items() if k != "job_id"}
               for r in records}
    assert sorted(kept) == sorted(spooled) == [(s, r) for s in steps for r in range(4)]
    assert all(kept[key] == spooled[key] for key in kept)


def test_the_export_is_readable_and_loads_back_as_the_trained_model(baseline, storage):
    """Every export file is as readable as the umask allows (config.json's mode), and
    ``load_exported`` gives the trained parameters (the run's own full copy) and the
    logits of a model built here and given them."""
    from service.job.models.builtin import build_model
    from service.job.models.exported import load_exported

    export = os.path.join(storage, "baseline", "export")
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {name: os.stat(os.path.join(export, name)).st_mode & 0o777
             for name in os.listdir(export)}
    assert any(n.endswith(".safetensors") for n in modes)
    assert set(modes.values()) == {0o666 & ~umask}, modes
    params = baseline[1]
    loaded = load_exported(export)
    assert sorted(loaded.state_dict()) == sorted(params)
    for key, value in params.items():
        assert torch.equal(loaded.state_dict()[key], value), key
    reference = build_model("tiny", dtype=torch.float32, seed=0)
    reference.load_state_dict(params)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), reference(tokens))


def test_tensorboard_mlflow_and_wandb_hold_every_steps_loss(baseline, storage,
                                                            mlflow_server):
    """The documented ``tensorboard --logdir <storage>`` serves the job's loss, every step
    (float32, as TensorBoard keeps scalars); the MLflow server and the W&B offline run
    hold the same mean over ranks of the first complete set of each step's records in
    ``metrics.jsonl``, in float64 exactly."""
    first: dict[int, dict[int, float]] = {}
    for rec in _records(storage, "baseline"):
        first.setdefault(rec["step"], {}).setdefault(rec["rank"], rec["loss"])
    assert sorted(first) == list(range(1, 9)) and all(len(r) == 4 for r in first.values())
    loss = [(s, math.fsum(first[s].values()) / 4) for s in sorted(first)]
    with TensorBoard(storage) as tensorboard:
        served = tensorboard.scalars("baseline/tensorboard", "loss", steps=8)
    assert served == [(s, float(np.float32(v))) for s, v in loss]
    run, history = mlflow_run(mlflow_server.url, "baseline")
    assert history["loss"] == loss and run.info.status == "FINISHED"
    assert wandb_run(os.path.join(storage, "baseline"))[1]["loss"] == loss


def test_worker_killed_at_step_6_resumes_from_step_4(baseline, storage, data_root):
    marker = os.path.join(storage, "fault-fired")
    records, params = _run(storage, data_root, "faulty", fault=f"1:6:{marker}")
    assert os.path.exists(marker)
    first = [r["step"] for r in records if r["rank"] == 0 and r["resumed_from"] == 0]
    second = [r["step"] for r in records if r["rank"] == 0 and r["resumed_from"] > 0]
    # the first attempt reported from step 1 (reports still in flight when a worker dies
    # are lost); the restarted group resumed from the checkpoint of step 4
    assert first == list(range(1, len(first) + 1)) and len(first) <= 5
    assert {r["resumed_from"] for r in records if r["resumed_from"] > 0} == {4}
    assert second == [5, 6, 7, 8]
    # the event file has each step the spool has, once (a report lost in flight, as
    # step 4's was in one run here, is in neither)
    got, expect = _tensorboard_loss(storage, "faulty")
    assert got == expect and [s for s, _ in got] == sorted({r["step"] for r in records})
    assert len(event_files(os.path.join(storage, "faulty", "tensorboard"))) == 1
    for key, value in baseline[1].items():
        assert torch.equal(params[key], value), key
    # each checkpoint stored once: in the job's dcp/, none in Ray Train's run directory
    # (<storage>/<job>, the same directory) or anywhere else under the storage root
    held = sorted(os.path.relpath(d, storage) for d, _, files in os.walk(storage)
                  if any(f.endswith(".distcp") or f == "dmuon_manifest.json" for f in files))
    assert held == [f"{job}/dcp/step_00000{s}" for job in ("baseline", "faulty")
                    for s in (4, 8)], held


def test_ray_job_submit_runs_the_stored_plan_with_json_lines(head, storage, tmp_path,
                                                             data_root):
    """The spec asks 2 x 2; the stored plan says 1 x 4: the plan is what runs."""
    from service.job.plan.make import plan_document

    data = {**SPEC, "steps": 3, "checkpoint": {"interval": 0}}
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(data))
    plan = plan_document(parse_spec({**data, "layout": {"replicate": 1, "shard": 4}}),
                         None, 4)
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    env = {**os.environ, "RAY_ADDRESS": head.dashboard}
    runtime_env = {"excludes": [".venv", ".git", "*.pt", "bench/results"]}
    proc = subprocess.run(
        [RAY, "job", "submit", "--working-dir", ROOT,
         "--runtime-env-json", json.dumps(runtime_env), "--",
         sys.executable, "-m", "service.driver.job_driver", "--spec", str(spec),
         "--plan", str(tmp_path / "plan.json"), "--storage", storage,
         "--data-root", data_root, "--job-id", "submitted"],
        env=env, capture_output=True, text=True, timeout=300)
    assert "SUCCEEDED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the job's stdout, as `ray job submit` relays it (lines may carry a log prefix): a
    # line per step with the mean of the ranks' losses (from the spool, counted here)
    records = _records(storage, "submitted")
    steps = [re.search(r"step (\d+)  loss (\S+) \(mean of 4 ranks\)  lr muon (\S+) "
                       r"adamw (\S+)  (\S+) s/step$", line) for line in proc.stdout.splitlines()]
    steps = [m.groups() for m in steps if m]
    assert [int(s[0]) for s in steps] == [1, 2, 3], proc.stdout[-2000:]
    for step, loss, muon, adamw, seconds in steps:
        mine = [r for r in records if r["step"] == int(step)]
        first = next(r for r in mine if r["rank"] == 0)
        assert loss == f"{sum(r['loss'] for r in mine) / 4:.4f}"
        assert (muon, adamw) == (f"{first['lr']['muon']:.3e}", f"{first['lr']['adamw']:.3e}")
        assert seconds == f"{first['step_time_s']:.3f}"
    assert "Reporting training result" not in proc.stdout  # Ray Train's INFO: its files only
    summary = json.loads(next(line[line.index('{"'):] for line in proc.stdout.splitlines()
                              if '{"summary": ' in line))["summary"]
    assert summary["status"] == "SUCCEEDED" and summary["layout"] == [1, 4]
    assert {tuple(r["coord"]) for r in records} == {
        (0, 0), (0, 1), (0, 2), (0, 3)}


def test_entrypoint_refuses_a_stored_plan_the_cluster_no_longer_holds(head, tmp_path,
                                                                     data_root):
    from service.job.plan.make import plan_document

    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(SPEC))
    plan = plan_document(parse_spec({**SPEC, "layout": {"nodes": 2, "workers_per_node": 2}}),
                         None, 4)  # planned on 2 assumed nodes; the head is 1 node
    (tmp_path / "plan.json").write_text(plan.model_dump_json())
    proc = subprocess.run(
        [sys.executable, "-m", "service.driver.job_driver", "--spec", str(spec), "--plan",
         str(tmp_path / "plan.json"), "--storage", str(tmp_path), "--data-root", data_root],
        env={**os.environ, "RAY_ADDRESS": head.address}, capture_output=True, text=True,
        timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "the stored plan (2 x 2 on 2 node(s)" in proc.stderr
    assert "no longer fits: 1 of the cluster's 1 alive node(s) can hold 2" in proc.stderr


def test_a_local_head_leaves_no_multiprocessing_dir_behind(monkeypatch):
    """The service's head (``dmuon-serve`` starts it so): Ray's dashboard runs a
    multiprocessing forkserver, whose ``pymp-*`` dir stayed in /tmp once it was killed.
    TMPDIR is a short dir of the test's own (Ray's socket paths must stay short)."""
    import glob
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="dmt-", dir="/tmp")
    monkeypatch.setenv("TMPDIR", tmp)
    monkeypatch.setattr(tempfile, "tempdir", tmp)
    try:
        head = LocalRayHead.start(num_cpus=1)
        try:
            assert head.temp_dir.startswith(tmp)
            # the forkserver's dir, in the head's own temp dir
            assert glob.glob(os.path.join(head.temp_dir, "tmp", "pymp-*"))
        finally:
            head.stop()
        assert sorted(os.listdir(tmp)) == []  # no pymp-*, no head temp dir
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    assert not os.path.exists(second.temp_dir)  # nor its temp dir (issue 43, item 11)


def test_service_plans_on_the_attached_clusters_nodes(head, tmp_path):
    """The control plane attached to a running cluster plans on its nodes (1 x 4 CPUs
    here), as the job's entrypoint will, not on the nodes it assumes without one."""
    from helpers.service_http import Service

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


def test_two_simulated_nodes_replicate_across_shard_within(baseline, storage, data_root):
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # leave the head for a 2-node cluster of our own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, log_to_driver=False)
        from service.driver.job_driver import run_job
        from service.job.inputs import resolve_inputs

        spec = parse_spec({**SPEC, "layout": {}})  # auto: 2 nodes x 2 workers
        params_path = os.path.join(storage, "two_nodes.params.pt")
        _, layout, _ = run_job(spec, job_id="two_nodes", storage=storage,
                               return_params=params_path,
                               inputs=resolve_inputs(spec, data_root))
        assert (layout.replicate, layout.shard) == (2, 2)
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


# -- the runner against real Ray's job API (defects 3, 4 and 10 of issue #15) --------------
SLEEPER = (sys.executable, "-c", "import time; time.sleep(120)")  # argv after -c: ignored


@pytest.fixture
def runner(head, tmp_path, monkeypatch):
    from service.control import submitter as runner_module
    from service.control.store import JobStore

    # jobs run a sleeper instead of training: these tests are about the queue
    monkeypatch.setattr(runner_module, "ENTRYPOINT", SLEEPER)
    store = JobStore(f"sqlite:///{tmp_path}/db.sqlite")
    made = runner_module.RayJobRunner(store, head.dashboard, storage=str(tmp_path / "a b"),
                                      data_root=str(tmp_path), service_url="http://x",
                                      max_running=3)
    yield made
    for job in store.list_jobs():
        made.stop_quietly(job["id"])
    store.close()


def _ray_status(runner, job_id, wanted, timeout=60):
    deadline = time.time() + timeout
    while (status := str(runner.client.get_job_status(job_id).value)) not in wanted:
        assert time.time() < deadline, f"{job_id} still {status} on Ray"
        time.sleep(0.3)
    return status


def _job(store, name="j"):
    return store.create_job(name, {"name": name}, dry_run=False, plan={})[0]["id"]


def test_runner_goes_on_past_a_job_ray_forgot_and_one_it_already_has(runner):
    store = runner.store
    forgotten = _job(store, "forgotten")  # RUNNING in the store; Ray has no such job
    store.queue.claim_next(3, "h")
    assert store.queue.mark_submitted(forgotten)
    # the service was killed between submit_job and storing RUNNING: Ray has it already
    resubmitted = _job(store, "resubmitted")
    runner.client.submit_job(entrypoint=" ".join(SLEEPER[:2]) + " 'import time; "
                             "time.sleep(120)'", submission_id=resubmitted)
    queued = _job(store, "queued")  # behind both
    runner.sync()
    assert store.get_job(forgotten)["status"] == "FAILED"
    assert "Ray has no record" in store.get_job(forgotten)["message"]
    assert store.get_job(resubmitted)["status"] == "RUNNING"
    assert store.get_job(queued)["status"] == "RUNNING"
    assert _ray_status(runner, queued, {"RUNNING", "PENDING"})
    runner.sync()  # and again: no error repeats on every tick
    assert [j["id"] for j in store.list_jobs("RUNNING")] == [queued, resubmitted]


def test_cancel_while_the_runner_submits_stops_the_job_on_ray(runner):
    """The issue's interleaving: the runner has claimed the job; cancel arrives before
    Ray has it (so there is nothing to stop yet); the submission lands afterwards. The
    store says STOPPED, and so, once the runner has reconciled, does Ray."""
    store = runner.store
    job_id = _job(store)
    claimed = store.queue.claim_next(3, "h")
    assert claimed["id"] == job_id
    job, on_ray = store.cancel(job_id)
    assert job["status"] == "STOPPED" and on_ray
    runner.stop_quietly(job_id)  # what the API does; Ray does not know the job yet
    runner.client.submit_job(entrypoint=runner.command(claimed, "token"), submission_id=job_id)
    runner.sync()
    assert _ray_status(runner, job_id, {"STOPPED", "FAILED"}) == "STOPPED"
    runner.sync()
    assert store.get_job(job_id)["status"] == "STOPPED" and store.queue.on_ray() == []


def test_entrypoint_command_is_quoted_and_carries_no_admin_token(runner, monkeypatch):
    import shlex

    from service.control import submitter as runner_module

    monkeypatch.setattr(runner_module, "ENTRYPOINT", ("python", "-m", "service.driver.job_driver"))
    monkeypatch.setenv("DMUON_API_TOKEN", "the-admin-token")
    job = {"id": "dmuon-0123456789ab", "spec": {"name": "x"}, "plan": {}}
    argv = shlex.split(runner.command(job, "job-token"))
    storage = argv[argv.index("--storage") + 1]
    assert storage == runner.storage and " " in storage  # one argument, space and all
    token_file = argv[argv.index("--token-file") + 1]
    assert open(token_file).read() == "job-token" and os.stat(token_file).st_mode & 0o777 == 0o600
    assert "the-admin-token" not in " ".join(argv)
    from service.control.ray_entrypoint import FORWARDED_ENV

    assert "DMUON_API_TOKEN" not in FORWARDED_ENV


def test_a_cancelled_jobs_kept_steps_reach_its_metrics(runner):
    """A job cancelled while its last steps' reports were still on their way to Ray
    Train's controller (the sleeper stands for it; its ranks' records are written by the
    workers' own function): once Ray says STOPPED, the store holds those steps of every
    rank; a record the job posted stays as posted, a line cut short by the kill is left
    out, and so is a step not every rank of its layout kept."""
    from service.control.step_records import StepRecord, ingest
    from service.worker.rank_records import keep_record

    store = runner.store
    job_id = _job(store, "cancelled")
    assert runner.submit_next()
    job_dir = os.path.join(runner.storage, job_id)
    kept = [{"step": s, "rank": r, "loss": 5.0 - s / 10 + r / 100, "step_time_s": 0.1,
             "layout": [1, 2]} for s in (2, 3, 4) for r in range(2)]
    for record in kept:
        keep_record(job_dir, record)
    keep_record(job_dir, {**kept[0], "step": 5})  # rank 1 never kept step 5
    with open(os.path.join(job_dir, "rank_records", "rank_00001.jsonl"), "a") as fh:
        fh.write('{"step": 5, "rank": 1, "lo')  # the kill came mid-line
    posted = StepRecord.model_validate({**kept[0], "job_id": job_id, "loss": 9.5})
    ingest(store, job_id, [posted], "post")
    assert store.cancel(job_id)[1]
    runner.stop_quietly(job_id)
    assert _ray_status(runner, job_id, {"STOPPED"}) == "STOPPED"
    runner.sync()
    assert store.queue.on_ray() == []  # settled
    got = {(m["step"], m["rank"]): m["loss"] for m in store.records.all(job_id)}
    assert got == {(2, 0): 9.5, **{(r["step"], r["rank"]): r["loss"] for r in kept[1:]}}


def test_a_cancelled_job_ends_its_tracking_runs_and_keeps_every_step(
        head, mlflow_server, tmp_path, monkeypatch):
    """Issue 43, items 2-4: a training job on 1 x 2 workers, through the runner, with
    MLflow and W&B, cancelled between its checkpoints of steps 4 and 8 while a second
    Ray instance lives on the machine. Ray Train's controller takes a report every 3 s
    here, so the spool lags the workers by a step or two (such a cancel used to leave
    steps 1-2 and 4 in the store: a hole at 3). Once Ray says STOPPED: the store holds
    every step from 1 to the last one both ranks ran, each rank's; the MLflow run is
    KILLED with an end time and the W&B run has its exit record, each read back with
    its own tool; the job's log holds no traceback."""
    from service.control import ray_entrypoint
    from service.control import submitter as runner_module
    from service.control.store import JobStore
    from service.job.plan.make import plan_document
    from service.worker.checkpoints import committed

    monkeypatch.setattr(ray_entrypoint, "JOB_ENV", {
        **ray_entrypoint.JOB_ENV, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "3"})
    spec = {"name": "stopped", "model": "tiny", "steps": 40, "batch_size": 4,
            "seq_len": 32, "layout": {"replicate": 1, "shard": 2},
            "checkpoint": {"interval": 4}, "data": {"val_every": 0},
            "metrics": {"mlflow": {"tracking_uri": mlflow_server.wait().url},
                        "wandb": {"mode": "offline"}}}
    plan = plan_document(parse_spec(spec), None, 2).model_dump(mode="json")
    store = JobStore(f"sqlite:///{tmp_path}/db.sqlite")
    runner = runner_module.RayJobRunner(store, head.dashboard, storage=str(tmp_path / "runs"),
                                        data_root=str(tmp_path), service_url="http://127.0.0.1:9")
    neighbour = LocalRayHead.start(num_cpus=1)
    try:
        job_id = store.create_job("stopped", spec, dry_run=False, plan=plan)[0]["id"]
        assert runner.submit_next()
        job_dir = os.path.join(runner.storage, job_id)
        deadline = time.time() + 240
        while not committed(os.path.join(job_dir, "dcp")):
            assert time.time() < deadline, runner.logs(job_id)[-3000:]
            assert runner.status_of(job_id) in ("PENDING", "RUNNING"), runner.logs(job_id)
            time.sleep(0.2)
        assert store.cancel(job_id)[1]
        runner.stop_quietly(job_id)  # what the API does
        assert _ray_status(runner, job_id, {"STOPPED"}, timeout=90) == "STOPPED"
        runner.sync()
        log = runner.logs(job_id)
    finally:
        neighbour.stop()
        store.close()
    assert store.get_job(job_id)["status"] == "STOPPED" and not store.queue.on_ray()
    newest = os.path.basename(committed(os.path.join(job_dir, "dcp"))[-1])
    assert newest == "step_000004", newest  # stopped between two checkpoints
    ranks: dict[int, list[int]] = {}
    for m in store.records.all(job_id):
        ranks.setdefault(m["step"], []).append(m["rank"])
    last = max(ranks)
    assert sorted(ranks) == list(range(1, last + 1)), sorted(ranks)  # no hole
    assert all(sorted(r) == [0, 1] for r in ranks.values()), ranks
    ran = {}
    for path in glob.glob(os.path.join(job_dir, "rank_records", "*")):
        with open(path) as fh:
            for r in map(json.loads, fh):
                ran.setdefault(r["step"], set()).add(r["rank"])
    assert last == max(s for s, r in ran.items() if r == {0, 1}) >= 4
    run, history = mlflow_run(mlflow_server.url, job_id)
    assert run.info.status == "KILLED", run.info
    assert run.info.end_time is not None and run.info.end_time >= run.info.start_time
    drawn = [s for s, _ in history["loss"]]
    assert drawn == list(range(1, len(drawn) + 1)) and len(drawn) <= last
    records, in_wandb = wandb_run(job_dir)
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [130]
    assert [s for s, _ in in_wandb["loss"]] == drawn
    assert "Traceback" not in log and "multiple active Ray instances" not in log, log
    assert "stopping: SIGTERM received" in log, log[-3000:]
