"""Moves queued jobs onto Ray through its job API and keeps their status in sync.

A job's id is its Ray submission id. At most ``max_running`` jobs are on Ray at a time
(counted in the store, so across replicas); the rest wait in the service's queue
(PENDING). Each tick reconciles every job that Ray holds, then submits while there is
room; one job's failure is logged and never stops the others.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import threading
import time

from service.job import failure
from service.job.inputs.working_dir import PackageError
from service.job.job_dir import FAILURE
from service.job.plan.inventory import NodeInfo

from .auth import token_hash
from .ray_entrypoint import entrypoint_command, export_command, runtime_env
from .ray_head import CachedInventory
from .sql_tables import CLAIMED, TERMINAL
from .step_records import read_rank_records, read_spool, spool_path
from .store import JobStore

INVENTORY_TTL_S = 10.0
CLAIM_TIMEOUT_S = 60.0  # a claim this old that Ray never got goes back to the queue
STOP_ALL_TIMEOUT_S = 45.0  # a shutdown's wait for its jobs (each has 30 s to stop)
ENTRYPOINT = (sys.executable, "-m", "service.driver.job_driver")  # what Ray runs per job


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


def _reported(result: tuple[int, list[str]], what: str) -> int:
    """How many records were stored; each malformed one reported and skipped."""
    stored, problems = result
    for problem in problems:
        _log(f"skipped {what}: {problem}")
    return stored


def _unknown_to_ray(store: JobStore, job: dict) -> None:
    if job["ray"] != CLAIMED:
        store.queue.settle(job["id"], "FAILED", "Ray has no record of this job (the cluster "
                                                "was replaced or restarted)")
    elif time.time() - (job["claimed_at"] or 0) > CLAIM_TIMEOUT_S:
        store.queue.release_claim(job["id"])  # its submitter died before Ray had it


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
        self._inventory = CachedInventory(ray_address, INVENTORY_TTL_S, _log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dmuon-runner", daemon=True)

    def inventory(self) -> list[NodeInfo]:
        return self._inventory.nodes()

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
        for job in self.store.queue.on_ray():
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
            _unknown_to_ray(self.store, job)
            return
        if job["ray"] == CLAIMED and not self.store.queue.mark_submitted(job_id):
            self.stop_quietly(job_id)  # its submitter died after Ray had it; cancelled since
        self.ingest_spool(job_id, job["spool_offset"])
        status = str(info.status.value)
        if status in TERMINAL:
            self.ingest_rank_records(job_id)
            # what the first failing rank (or the entrypoint) wrote: type, message, rank
            reason = failure.sanitized(failure.read_reason(os.path.join(
                self.storage, job_id, FAILURE))) if status == "FAILED" else None
            self.store.queue.settle(job_id, status, outcome_message(job_id, info.message, reason),
                              reason)
        elif job["status"] in TERMINAL:
            self.client.stop_job(job_id)  # cancelled in the store, still on Ray: again

    def stop_all(self, timeout_s: float = STOP_ALL_TIMEOUT_S) -> None:
        """Stop every job Ray holds and settle each once Ray says it ended (waiting at
        most ``timeout_s`` in all): before the service stops its local head, so a job
        ends as a cancel ends it (its trackers' runs KILLED, its last steps kept), not
        killed with the head and found FAILED by the next service. Call after
        ``close``: nothing is submitted meanwhile."""
        jobs = self.store.queue.on_ray()
        for job in jobs:
            self.stop_quietly(job["id"])
        deadline = time.monotonic() + timeout_s
        for job in jobs:
            while time.monotonic() < deadline and self._guarded(
                    f"waiting for {job['id']} to stop", self.status_of,
                    job["id"]) not in (*TERMINAL, None):
                time.sleep(0.5)
            self._guarded(f"reconciling {job['id']}", self.reconcile, job)

    def submit_next(self) -> bool:
        """Claim the oldest queued job if there is room, and hand it to Ray; False when
        nothing was claimed."""
        token = secrets.token_urlsafe(32)
        job = self.store.queue.claim_next(self.max_running, token_hash(token))
        if job is None:
            return False
        try:
            env = runtime_env(job, self.storage)
        except PackageError as e:  # checked on submission; deleted since
            self.store.queue.settle(job["id"], "FAILED", str(e))
            return True
        _submit_claimed(self.client, self.store, job, self.command(job, token), env)
        if not self.store.queue.mark_submitted(job["id"]):
            self.stop_quietly(job["id"])  # cancelled while we submitted it
        return True

    def command(self, job: dict, token: str) -> str:
        return entrypoint_command(ENTRYPOINT, job, token, storage=self.storage,
                                  data_root=self.data_root, service_url=self.service_url)

    def submit_export(self, job: dict) -> str:
        """A Ray job that rebuilds the finished job on its stored plan, loads its newest
        checkpoint and exports it (``--export-only``); returns its submission id."""
        submission = f"{job['id']}-export-{secrets.token_hex(4)}"
        self.client.submit_job(
            entrypoint=export_command(ENTRYPOINT, job, storage=self.storage,
                                      data_root=self.data_root),
            submission_id=submission, runtime_env=runtime_env(job, self.storage))
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
        service is down)."""
        return _reported(read_spool(self.store, job_id, spool_path(self.storage, job_id), offset),
                      "a spool line")

    def ingest_rank_records(self, job_id: str) -> int:
        """The records of the job's steps the store lacks, from the ranks' own files: a
        cancel stops the job before its last reports reach the spool, not before the
        ranks kept them."""
        return _reported(read_rank_records(self.store, job_id, os.path.join(self.storage, job_id)),
                      "a rank's record")

    def stop_quietly(self, job_id: str) -> None:
        """Ask Ray to stop a job; the next reconcile asks again if this fails."""
        self._guarded(f"stopping {job_id}", self.client.stop_job, job_id)

    def logs(self, job_id: str) -> str:
        return self.client.get_job_logs(job_id)

    async def tail(self, job_id: str):
        async for chunk in self.client.tail_job_logs(job_id):
            yield chunk


def _submit_claimed(client, store: JobStore, job: dict, entrypoint: str, env: dict) -> None:
    """Hand a claimed job to Ray's job API under its own id: a job Ray already holds (its
    submitter stopped before recording it) is left as it is; any other refusal releases
    the claim."""
    try:
        client.submit_job(entrypoint=entrypoint, submission_id=job["id"], runtime_env=env)
    except RuntimeError as e:
        if "already exists" not in str(e):
            store.queue.release_claim(job["id"])
            raise
        _log(f"{job['id']} was already on Ray (its submitter stopped before recording it)")
