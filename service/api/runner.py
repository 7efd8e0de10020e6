"""Moves queued jobs onto Ray through its job API and keeps their status in sync.

A job's id is its Ray submission id. At most ``max_running`` jobs are on Ray at a time;
the rest wait in the service's own queue (PENDING). Statuses follow Ray's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

from .planner import NodeInfo, inventory_from_dashboard
from .store import TERMINAL, JobStore
from .train import FAULT_ENV

INVENTORY_TTL_S = 10.0


class RayJobRunner:
    def __init__(self, store: JobStore, ray_address: str, storage: str, service_url: str,
                 max_running: int = 1, interval_s: float = 0.5):
        from ray.job_submission import JobSubmissionClient

        self.store, self.storage, self.service_url = store, storage, service_url
        self.max_running, self.interval_s = max_running, interval_s
        self.client, self.ray_address = JobSubmissionClient(ray_address), ray_address
        self._inventory: tuple[float, list[NodeInfo]] = (-math.inf, [])
        self._inventory_lock = threading.Lock()
        self._offsets: dict[str, int] = {}  # bytes of each spool already ingested
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
                    print(f"runner: cannot read the cluster's nodes: {e}", file=sys.stderr)
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
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - keep serving; the next tick retries
                print(f"runner: {type(e).__name__}: {e}", file=sys.stderr)

    def sync(self) -> None:
        """Reconcile running jobs with Ray (and their metrics with the spool each job
        writes), then start queued ones while there is room."""
        running = self.store.list_jobs("RUNNING")
        for job in running:
            # status first: a job that has ended wrote its whole spool before this read
            status = str(self.client.get_job_status(job["id"]).value)
            self.ingest_spool(job["id"])
            if status in TERMINAL:
                self.store.set_status(job["id"], status, self._message(job["id"]))
        room = self.max_running - len(self.store.list_jobs("RUNNING"))
        for job in sorted(self.store.list_jobs("PENDING"), key=lambda j: j["created"]):
            if room <= 0:
                break
            if not job["dry_run"]:
                self._submit(job)
                room -= 1

    def _submit(self, job: dict) -> None:
        job_dir = os.path.join(self.storage, job["id"])
        os.makedirs(job_dir, exist_ok=True)
        spec_path = os.path.join(job_dir, "spec.json")
        with open(spec_path, "w") as fh:
            json.dump(job["spec"], fh)
        entrypoint = (f"{sys.executable} -m service.entrypoint --spec {spec_path} "
                      f"--storage {self.storage} --job-id {job['id']} "
                      f"--metrics-url {self.service_url}/v1/metrics")
        # FAULT_ENV: the tests' fault hook, unset in use
        env = {k: os.environ[k] for k in ("DMUON_API_TOKEN", "GLOO_SOCKET_IFNAME",
                                          "OMP_NUM_THREADS", FAULT_ENV) if k in os.environ}
        self.client.submit_job(entrypoint=entrypoint, submission_id=job["id"],
                               runtime_env={"env_vars": env})
        if not self.store.set_status(job["id"], "RUNNING"):
            self.client.stop_job(job["id"])  # cancelled while we submitted it

    def ingest_spool(self, job_id: str) -> int:
        """Records from ``<storage>/<job>/metrics.jsonl`` not yet stored (posts can be
        lost: the service may have been down)."""
        path = os.path.join(self.storage, job_id, "metrics.jsonl")
        offset = self._offsets.get(job_id, 0)
        if not os.path.exists(path) or os.path.getsize(path) <= offset:
            return 0
        with open(path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
        self._offsets[job_id] = offset + len(complete)
        records = [json.loads(line) for line in complete.decode().splitlines() if line]
        return self.store.add_metrics(records) if records else 0

    def stop(self, job_id: str) -> None:
        self.client.stop_job(job_id)

    def logs(self, job_id: str) -> str:
        return self.client.get_job_logs(job_id)

    async def tail(self, job_id: str):
        async for chunk in self.client.tail_job_logs(job_id):
            yield chunk

    def _message(self, job_id: str) -> str | None:
        return self.client.get_job_info(job_id).message
