"""The queue's side of the job store, which the runner works: the oldest queued job
claimed under the queue's lock while fewer than ``max_running`` are on Ray, the claim
marked submitted once Ray has it or released when it never got there, the job settled
when Ray says it ended, and what is on Ray to reconcile."""

from __future__ import annotations

import time

from sqlalchemy import func, select, update

from .sql_tables import CLAIMED, SETTLED, SUBMITTED, jobs, locks
from .status_moves import move_status

ON_RAY = (CLAIMED, SUBMITTED)


class RayQueue:
    """``JobStore.queue``."""

    def __init__(self, store):
        self._store = store

    def claim_next(self, max_running: int, token_hash: str) -> dict | None:
        """The oldest queued job, claimed for submission, if fewer than ``max_running``
        jobs are on Ray; the queue row's lock makes the count and the claim atomic."""
        with self._store.writer.begin() as conn:
            conn.execute(update(locks).where(locks.c.name == "queue").values(n=locks.c.n + 1))
            busy = conn.execute(select(func.count()).select_from(jobs)
                                .where(jobs.c.ray.in_(ON_RAY))).scalar_one()
            if busy >= max_running:
                return None
            job_id = conn.execute(
                select(jobs.c.id).where(jobs.c.status == "PENDING", jobs.c.ray.is_(None),
                                        jobs.c.dry_run.is_(False))
                .order_by(jobs.c.created).limit(1)).scalar()
            if job_id is None:
                return None
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(
                ray=CLAIMED, claimed_at=time.time(), job_token_hash=token_hash))
        return self._store.get_job(job_id)

    def mark_submitted(self, job_id: str) -> bool:
        """PENDING (claimed) -> RUNNING once Ray has the job; False if it was cancelled
        meanwhile (the job must then be stopped on Ray)."""
        with self._store.writer.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.ray == CLAIMED)
                         .values(ray=SUBMITTED))
            return move_status(conn, job_id, "RUNNING", None, jobs.c.status == "PENDING")

    def release_claim(self, job_id: str) -> None:
        """Back to the queue: a claim whose submission never reached Ray."""
        with self._store.writer.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.ray == CLAIMED)
                         .values(ray=None, claimed_at=None))

    def settle(self, job_id: str, status: str, message: str | None,
               reason: dict | None = None) -> None:
        """Ray says the job ended: record its final status, with why it failed when that
        is known (unless the store already had one, such as STOPPED), and stop watching
        it."""
        with self._store.writer.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id).values(ray=SETTLED))
            move_status(conn, job_id, status, message, reason=reason)

    def on_ray(self) -> list[dict]:
        """Jobs claimed or submitted and not yet settled: what the runner reconciles."""
        with self._store.reader.connect() as conn:
            rows = conn.execute(select(jobs.c.id, jobs.c.status, jobs.c.ray,
                                       jobs.c.claimed_at, jobs.c.spool_offset)
                                .where(jobs.c.ray.in_(ON_RAY))).all()
        return [dict(r._mapping) for r in rows]

    def job_token_hash(self, job_id: str) -> str | None:
        with self._store.reader.connect() as conn:
            return conn.execute(select(jobs.c.job_token_hash)
                                .where(jobs.c.id == job_id)).scalar()

    def advance_spool(self, job_id: str, offset: int) -> None:
        with self._store.writer.begin() as conn:
            conn.execute(update(jobs).where(jobs.c.id == job_id,
                                            jobs.c.spool_offset < offset)
                         .values(spool_offset=offset))
