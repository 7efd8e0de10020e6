"""One job's submission traced in one fresh process, side by side: the control plane (its
app under FastAPI's TestClient, attached to a cluster) takes ``POST /v1/jobs`` and its
runner hands the job to Ray's job API; the driver runs the command line the runner gave
Ray; one worker runs ``run_training`` on the ``Job`` the driver handed Ray Train.

Ray itself is stood in for where it would start processes: its job API (records the
command), its state API and ``ray.nodes`` (one alive node of 1 CPU) and Ray Train's
``TorchTrainer`` (its ``fit`` runs the one worker here, on a 1-rank gloo group, as
``service.worker.loop._worker`` does once Ray Train has made the group).

    python tests/helpers/job_path.py DIR     # writes DIR/trace.json: the files, sorted

A file counts when one of its functions ran: module and class bodies do not, nor any
function run while a module was being imported (what an import runs is no hand-off).
A fresh process, so no cache of an earlier test (a plan, a built model) hides a call.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import shlex
import sys
import threading
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACED = tuple(os.path.join(ROOT, p) + os.sep for p in ("service", "dmuon"))
# a small job of the built-in model, R x N = 1 x 1, on CPUs (gloo)
SPEC = {"model": "tiny", "steps": 2, "seq_len": 16, "batch_size": 1,
        "layout": {"replicate": 1, "shard": 1}}
ADMIN = "admin-token"
NODE = {"id": "node-0", "ip": "127.0.0.1", "resources": {"CPU": 1.0}}
RAY = "http://127.0.0.1:8265"  # the stand-in cluster's dashboard: nothing listens


def _importing(frame) -> bool:
    """Whether the frame runs inside an import (a module body below it on the stack)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


# the calls counted by side: each resolution of a spec's inputs (resolve_model runs in
# every one) and each build of the model on the meta device
COUNTED = {("service/job/inputs/resolve.py", "resolve_model"),
           ("service/job/inputs/resolve.py", "resolve_data"),
           ("service/job/models/build.py", "build_on_meta")}


class Trace:
    """The files of ``service/`` and ``dmuon/`` whose functions ran while it was on, in
    every thread started meanwhile (the TestClient's event loop, its worker threads),
    and the ``COUNTED`` calls by ``side`` (set as the job moves on)."""

    side = "control"

    def __init__(self):
        self.files: set[str] = set()
        self.by_side: dict[str, set[str]] = {}
        self.calls: dict[str, int] = {}
        self._counted = {os.path.join(ROOT, f) for f, _ in COUNTED}

    def _count(self, code) -> None:
        rel = os.path.relpath(code.co_filename, ROOT)
        if (rel, code.co_name) in COUNTED:
            key = f"{Trace.side}:{code.co_name}"
            self.calls[key] = self.calls.get(key, 0) + 1

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        name = code.co_filename
        if name in self._counted:
            self._count(code)
        side = self.by_side.setdefault(Trace.side, set())
        if name in side or not name.startswith(TRACED) \
                or not code.co_flags & inspect.CO_OPTIMIZED:  # a module or class body
            return
        if not _importing(frame.f_back):
            self.files.add(name)
            side.add(name)

    def __enter__(self) -> Trace:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def relative(self, files=None) -> list[str]:
        return sorted(os.path.relpath(f, ROOT) for f in (self.files if files is None else files))


class RayJobs:
    """Ray's job API (``JobSubmissionClient``) as the runner uses it to submit a job."""

    submitted: list[dict] = []

    def __init__(self, address: str):
        assert address == RAY, address

    def submit_job(self, *, entrypoint: str, submission_id: str, runtime_env: dict) -> str:
        self.submitted.append({"entrypoint": entrypoint, "id": submission_id})
        return submission_id


class RayTrain:
    """Ray Train's ``TorchTrainer``: ``fit`` runs one worker here, on the job handed in
    ``train_loop_config`` as every worker gets it."""

    fitted = None  # the trainer whose fit ran

    def __init__(self, loop, *, train_loop_config: dict, scaling_config, torch_config,
                 run_config):
        from service.worker import loop as worker_loop

        assert loop is worker_loop.train_loop_per_worker
        assert scaling_config.num_workers == 1 and torch_config.backend == "gloo"
        self.config, self.run_config = train_loop_config, run_config

    def fit(self):
        self.records = worker(self.config["job"], self.run_config.storage_path)
        RayTrain.fitted = self
        return types.SimpleNamespace(error=None)


def stand_in_for_ray(control_plane) -> None:
    """Ray's APIs the three sides call, answered here; the control plane's runner ticks
    when this process says (its loop waits for its close)."""
    import ray
    import ray.job_submission
    import ray.train.torch
    import ray.util.state

    node = types.SimpleNamespace(node_id=NODE["id"], node_ip=NODE["ip"], state="ALIVE",
                                 resources_total=NODE["resources"])
    ray.util.state.list_nodes = lambda **kwargs: [node]
    ray.nodes = lambda: [{"NodeID": NODE["id"], "NodeManagerAddress": NODE["ip"],
                          "Alive": True, "Resources": NODE["resources"]}]
    ray.job_submission.JobSubmissionClient = RayJobs
    ray.train.torch.TorchTrainer = RayTrain
    control_plane.RayJobRunner._loop = lambda runner: runner._stop.wait()


def submit(storage: str) -> tuple[dict, str]:
    """The control plane: ``POST /v1/jobs``, then one tick of its runner, which hands the
    job to Ray's job API. Returns (the job, the driver's command line)."""
    from fastapi.testclient import TestClient

    from service.control.app import create_app
    from service.control.settings import Settings

    settings = Settings(api_token=ADMIN, db=os.path.join(storage, "dmuon.db"),
                        storage=storage, ray_address=RAY)
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:
        answer = client.post("/v1/jobs", json={"spec": SPEC},
                             headers={"Authorization": f"Bearer {ADMIN}"})
        assert answer.status_code == 201, answer.text
        job = answer.json()
        assert job["status"] == "PENDING", job
        client.app.state.runner.sync()
        stored = client.app.state.store.get_job(job["id"])
    assert stored["status"] == "RUNNING", stored
    assert [s["id"] for s in RayJobs.submitted] == [job["id"]]
    return stored, RayJobs.submitted[0]["entrypoint"]


def drive(entrypoint: str) -> int:
    """The driver, on the command line the runner gave Ray's job API, attached to the
    stand-in cluster (no Ray started)."""
    argv = shlex.split(entrypoint)
    assert argv[:3] == [sys.executable, "-m", "service.driver.job_driver"], argv
    from service.driver import job_driver

    job_driver.connect_ray = lambda num_cpus=None: None  # the cluster is attached
    return job_driver.main(argv[3:])


def worker(job, storage: str) -> list[dict]:
    """One worker: what ``_worker`` does on Ray Train's process group, here a 1-rank
    gloo group of this process; returns the step records it reported."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from service.worker.loop import WorkerContext, run_training

    Trace.side = "worker"
    rendezvous = dist.FileStore(os.path.join(storage, "rendezvous"), 1)
    dist.init_process_group("gloo", store=rendezvous, rank=0, world_size=1)
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        records = []
        context = WorkerContext(node_ids=[NODE["id"]], node_ip=NODE["ip"])
        run_training(dataclasses.replace(job, plan=job.plan.for_world(1)), mesh,
                     lambda record, path: records.append(record), context)
        return records
    finally:
        dist.destroy_process_group()


def main(out: str) -> None:
    from service.control import submitter

    assert submitter.__file__.startswith(TRACED), submitter.__file__  # this checkout's
    storage = os.path.join(out, "runs")
    os.makedirs(storage)
    stand_in_for_ray(submitter)
    with Trace() as trace:
        job, entrypoint = submit(storage)
        Trace.side = "driver"
        code = drive(entrypoint)
    assert code == 0, code
    records = RayTrain.fitted.records
    assert [r["step"] for r in records] == [1, 2], records
    assert all(math.isfinite(r["loss"]) for r in records), records
    job_dir = os.path.join(storage, job["id"])
    with open(os.path.join(out, "trace.json"), "w") as fh:
        json.dump({"files": trace.relative(), "job_dir": sorted(os.listdir(job_dir)),
                   "calls": trace.calls,
                   "by_side": {k: trace.relative(v) for k, v in trace.by_side.items()}}, fh)


if __name__ == "__main__":
    main(sys.argv[1])
