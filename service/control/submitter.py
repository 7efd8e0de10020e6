"""Moves queued jobs onto Ray through its job API and keeps their status in sync.

A job's id is its Ray submission id. At most ``max_running`` jobs are on Ray at a time
(counted in the store, so across replicas); the rest wait in the service's queue
(PENDING). Each tick reconciles every job that Ray holds, then submits while there is
room; one job's failure is logged and never stops the others.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shlex
import sys
import threading
import time

from service.job import failure
from service.job.inputs.working_dir import PackageError, runtime_working_dir
from service.job.job_dir import FAILURE, JOB_TOKEN, PLAN, SPEC
from service.job.plan.inventory import NodeInfo

from .auth import token_hash
from .ray_head import inventory_from_dashboard
from .sql_tables import CLAIMED, TERMINAL
from .step_records import read_rank_records, read_spool, spool_path
from .store import JobStore

INVENTORY_TTL_S = 10.0
CLAIM_TIMEOUT_S = 60.0  # a claim this old that Ray never got goes back to the queue
STOP_ALL_TIMEOUT_S = 45.0  # a shutdown's wait for its jobs (each has 30 s to stop)
ENTRYPOINT = (sys.executable, "-m", "service.driver.job_driver")
FORWARDED_ENV = ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
# a job's log is a file the CLI and the dashboard read, never a terminal: Ray's process
# prefixes without colour codes. A cancel (Ray's stop_job) sends SIGTERM, on which the
# entrypoint aborts the run through Ray Train's controller, ending the trackers' runs;
# Ray's SIGKILL comes 3 s later by default, too soon for a W&B run to finish
JOB_ENV = {"RAY_COLOR_PREFIX": "0", "RAY_JOB_STOP_WAIT_TIME_S": "30"}


# Ray's job SDK logs "WebSocket closed for job ..." at INFO each time a followed log
# ends: the job's end, not the service's news, on the service's console
RAY_SDK_LOGGER = "ray.dashboard.modules.job.sdk"


def quiet_ray_sdk() -> None:
    logging.getLogger(RAY_SDK_LOGGER).setLevel(logging.WARNING)


def _log(message: str) -> None:
    print(f"runner: {message}", file=sys.stderr, flush=True)


def _missing(error: Exception) -> bool:
    """Ray's job API answers 404 for a submission id it does not know."""
    return isinstance(error, RuntimeError) and "status code 404" in str(error)


def outcome_message(job_id: str, ray_message: str | None, reason: dict | None) -> str | None:
    """The job's message: with a reason, its one line and where the whole log is;
    otherwise Ray's own (its log's tail), without terminal escape codes."""
    if reason is None:
        return failure.strip_ansi(ray_message)
    return (f"{failure.summary(reason)}; the full log: GET /v1/jobs/{job_id}/logs "
            f"(dmuon-svc logs {job_id})")


class RayJobRunner:
    def __init__(self, store: JobStore, ray_address: str, *, storage: str, data_root: str,
                 service_url: str, max_running: int = 1, interval_s: float = 0.5):
        from ray.job_submission import JobSubmissionClient

        quiet_ray_sdk()  # after the import: Ray sets its loggers up as it loads
        self.store, self.storage, self.data_root = store, storage, data_root
        self.service_url, self.max_running, self.interval_s = service_url, max_running, interval_s
        self.client, self.ray_address = JobSubmissionClient(ray_address), ray_address
        self._inventory: tuple[float, list[NodeInfo]] = (-math.inf, [])
        self._inventory_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dmuon-runner", daemon=True)

    def inventory(self) -> list[NodeInfo]:
        """The cluster's alive nodes, read at most every INVENTORY_TTL_S (submissions come
        in bursts); [] while the cluster cannot be read."""
        with self._inventory_lock:
            read_at, nodes = self._inventory
            if time.monotonic() - read_at > INVENTORY_TTL_S:
                try:
                    nodes = inventory_from_dashboard(self.ray_address)
                    # none yet (a new head registers its node within a second): ask again
                    read_at = time.monotonic() if nodes else -math.inf
                except Exception as e:  # noqa: BLE001 - Ray raises several kinds
                    _log(f"cannot read the cluster's nodes: {e}")
                    nodes, read_at = [], time.monotonic()
                self._inventory = (read_at, nodes)
            return nodes

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sync()

    def _guarded(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - one job's trouble must not stop the queue
            _log(f"{what}: {type(e).__name__}: {e}")
            return None

    def sync(self) -> None:
        """Reconcile every job Ray holds, then start queued ones while there is room."""
        for job in self.store.on_ray():
            self._guarded(f"reconciling {job['id']}", self.reconcile, job)
        while self._guarded("submitting", self.submit_next):
            pass

    def reconcile(self, job: dict) -> None:
        """Bring the store in line with what Ray says about one job."""
        job_id = job["id"]
        try:
            info = self.client.get_job_info(job_id)
        except RuntimeError as e:
            if not _missing(e):
                raise
            self._unknown_to_ray(job)
            return
        if job["ray"] == CLAIMED and not self.store.mark_submitted(job_id):
            self.stop_quietly(job_id)  # its submitter died after Ray had it; cancelled since
        self.ingest_spool(job_id, job["spool_offset"])
        status = str(info.status.value)
        if status in TERMINAL:
            self.ingest_rank_records(job_id)
            reason = self.failure_reason(job_id) if status == "FAILED" else None
            self.store.settle(job_id, status, outcome_message(job_id, info.message, reason),
                              reason)
        elif job["status"] in TERMINAL:
            self.client.stop_job(job_id)  # cancelled in the store, still on Ray: again

    def stop_all(self, timeout_s: float = STOP_ALL_TIMEOUT_S) -> None:
        """Stop every job Ray holds and settle each once Ray says it ended (waiting at
        most ``timeout_s`` in all): before the service stops its local head, so a job
        ends as a cancel ends it (its trackers' runs KILLED, its last steps kept), not
        killed with the head and found FAILED by the next service. Call after
        ``close``: nothing is submitted meanwhile."""
        jobs = self.store.on_ray()
        for job in jobs:
            self.stop_quietly(job["id"])
        deadline = time.monotonic() + timeout_s
        for job in jobs:
            while time.monotonic() < deadline and self._guarded(
                    f"waiting for {job['id']} to stop", self.status_of,
                    job["id"]) not in (*TERMINAL, None):
                time.sleep(0.5)
            self._guarded(f"reconciling {job['id']}", self.reconcile, job)

    def failure_reason(self, job_id: str) -> dict | None:
        """What the job's first failing rank (or its entrypoint) wrote: type, message,
        rank, step, frames; None when nothing did (the entrypoint never ran)."""
        return failure.sanitized(failure.read_reason(
            os.path.join(self.storage, job_id, FAILURE)))

    def _unknown_to_ray(self, job: dict) -> None:
        if job["ray"] != CLAIMED:
            self.store.settle(job["id"], "FAILED", "Ray has no record of this job (the "
                                                   "cluster was replaced or restarted)")
        elif time.time() - (job["claimed_at"] or 0) > CLAIM_TIMEOUT_S:
            self.store.release_claim(job["id"])  # its submitter died before Ray had it

    def submit_next(self) -> bool:
        """Claim the oldest queued job if there is room, and hand it to Ray; False when
        nothing was claimed."""
        token = secrets.token_urlsafe(32)
        job = self.store.claim_next(self.max_running, token_hash(token))
        if job is None:
            return False
        try:
            runtime_env = self.runtime_env(job)
        except PackageError as e:  # checked on submission; deleted since
            self.store.settle(job["id"], "FAILED", str(e))
            return True
        try:
            self.client.submit_job(entrypoint=self.command(job, token),
                                   submission_id=job["id"], runtime_env=runtime_env)
        except RuntimeError as e:
            if "already exists" not in str(e):
                self.store.release_claim(job["id"])
                raise
            _log(f"{job['id']} was already on Ray (its submitter stopped before recording it)")
        if not self.store.mark_submitted(job["id"]):
            self.stop_quietly(job["id"])  # cancelled while we submitted it
        return True

    def runtime_env(self, job: dict) -> dict:
        """The job's environment on Ray: forwarded variables, and its working_dir (an
        uploaded package's directory, which Ray's job API uploads, or a Ray URI)."""
        env = {"env_vars": {**{k: os.environ[k] for k in FORWARDED_ENV if k in os.environ},
                            **JOB_ENV}}
        if job["spec"].get("working_dir"):
            env["working_dir"] = runtime_working_dir(self.storage, job["spec"]["working_dir"])
        return env

    def command(self, job: dict, token: str) -> str:
        """The entrypoint's command line (Ray runs it through a shell: every part quoted).
        The job gets the stored spec and plan, and its own token in a private file."""
        job_dir = os.path.join(self.storage, job["id"])
        os.makedirs(job_dir, exist_ok=True)
        files = {SPEC: job["spec"], PLAN: job["plan"]}
        for name, data in files.items():
            with open(os.path.join(job_dir, name), "w") as fh:
                json.dump(data, fh)
        token_file = os.path.join(job_dir, JOB_TOKEN)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token)
        return shlex.join([
            *ENTRYPOINT, "--spec", os.path.join(job_dir, SPEC),
            "--plan", os.path.join(job_dir, PLAN), "--storage", self.storage,
            "--data-root", self.data_root, "--job-id", job["id"],
            "--metrics-url", f"{self.service_url}/v1/jobs/{job['id']}/metrics",
            "--plan-url", f"{self.service_url}/v1/jobs/{job['id']}/plan",
            "--token-file", token_file])

    def submit_export(self, job: dict) -> str:
        """A Ray job that rebuilds the finished job on its stored plan, loads its newest
        checkpoint and exports it (``--export-only``); returns its submission id."""
        job_dir = os.path.join(self.storage, job["id"])
        submission = f"{job['id']}-export-{secrets.token_hex(4)}"
        command = shlex.join([
            *ENTRYPOINT, "--spec", os.path.join(job_dir, SPEC),
            "--plan", os.path.join(job_dir, PLAN), "--storage", self.storage,
            "--data-root", self.data_root, "--job-id", job["id"], "--export-only"])
        self.client.submit_job(entrypoint=command, submission_id=submission,
                               runtime_env=self.runtime_env(job))
        return submission

    def has_job(self, submission_id: str) -> bool:
        """Whether this cluster's job API knows the submission (a job registered by its
        entrypoint must be one of them: the runner follows it there)."""
        try:
            self.client.get_job_info(submission_id)
        except RuntimeError as e:
            if not _missing(e):
                raise
            return False
        return True

    def status_of(self, submission_id: str) -> str:
        return str(self.client.get_job_status(submission_id).value)

    def ingest_spool(self, job_id: str, offset: int) -> int:
        """Records the job spooled that are not stored yet (posts can be lost while the
        service is down); malformed lines are reported and skipped."""
        stored, problems = read_spool(self.store, job_id, spool_path(self.storage, job_id),
                                      offset)
        for problem in problems:
            _log(f"skipped a spool line: {problem}")
        return stored

    def ingest_rank_records(self, job_id: str) -> int:
        """The records of the job's steps the store lacks, from the ranks' own files: a
        cancel stops the job before its last reports reach the spool, not before the
        ranks kept them."""
        stored, problems = read_rank_records(self.store, job_id,
                                             os.path.join(self.storage, job_id))
        for problem in problems:
            _log(f"skipped a rank's record: {problem}")
        return stored

    def stop_quietly(self, job_id: str) -> None:
        """Ask Ray to stop a job; the next reconcile asks again if this fails."""
        self._guarded(f"stopping {job_id}", self.client.stop_job, job_id)

    def logs(self, job_id: str) -> str:
        return self.client.get_job_logs(job_id)

    async def tail(self, job_id: str):
        async for chunk in self.client.tail_job_logs(job_id):
            yield chunk
