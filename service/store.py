"""Persistent job store: jobs, specs, status history and per-rank metrics in SQLite.

Metrics are keyed by (job, step, rank), so re-ingesting a record (a retried post, the
JSONL spool re-read after a restart) never duplicates it. One connection per call keeps
the store safe to use from the API's threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import uuid

STATES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL,
    dry_run INTEGER NOT NULL, idempotency_key TEXT UNIQUE, plan TEXT,
    message TEXT, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS status_history (
    job_id TEXT NOT NULL, status TEXT NOT NULL, time REAL NOT NULL, message TEXT);
CREATE TABLE IF NOT EXISTS metrics (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (job_id, step, rank));
"""


class JobStore:
    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()  # serialises writers; SQLite allows one at a time
        with self._connect() as db:
            db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _connect(self):
        db = sqlite3.connect(self.path, timeout=30)
        db.row_factory = sqlite3.Row
        try:
            with db:
                yield db
        finally:
            db.close()

    def create_job(self, name: str, spec: dict, *, dry_run: bool, plan: dict | None,
                   idempotency_key: str | None = None, status: str = "PENDING") -> dict:
        """A new job, or the one an earlier request with the same key created."""
        now, idempotency_key = time.time(), idempotency_key or None  # "" is no key
        job_id = f"dmuon-{uuid.uuid4().hex[:12]}"
        with self._lock, self._connect() as db:
            if idempotency_key:
                row = db.execute("SELECT * FROM jobs WHERE idempotency_key = ?",
                                 (idempotency_key,)).fetchone()
                if row is not None:
                    return self._job(row)
            db.execute(
                "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, name, json.dumps(spec), status, int(dry_run), idempotency_key,
                 json.dumps(plan) if plan is not None else None, None, now, now))
            db.execute("INSERT INTO status_history VALUES (?, ?, ?, ?)",
                       (job_id, status, now, None))
        return self.get_job(job_id)

    def get_job(self, job_id: str) -> dict | None:
        with self._connect() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            return self._job(row) if row else None

    def list_jobs(self, status: str | None = None, limit: int = 1000) -> list[dict]:
        query, args = "SELECT * FROM jobs", ()
        if status:
            query, args = query + " WHERE status = ?", (status,)
        with self._connect() as db:
            rows = db.execute(query + " ORDER BY created DESC LIMIT ?", (*args, limit))
            return [self._job(r) for r in rows.fetchall()]

    def set_status(self, job_id: str, status: str, message: str | None = None) -> bool:
        """Move a job to ``status``; a terminal job never moves again. True if it moved."""
        if status not in STATES:
            raise ValueError(f"unknown status {status!r}")
        now = time.time()
        with self._lock, self._connect() as db:
            row = db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or row["status"] in TERMINAL or row["status"] == status:
                return False
            db.execute("UPDATE jobs SET status = ?, message = ?, updated = ? WHERE id = ?",
                       (status, message, now, job_id))
            db.execute("INSERT INTO status_history VALUES (?, ?, ?, ?)",
                       (job_id, status, now, message))
        return True

    def history(self, job_id: str) -> list[dict]:
        with self._connect() as db:
            rows = db.execute("SELECT status, time, message FROM status_history "
                              "WHERE job_id = ? ORDER BY rowid", (job_id,)).fetchall()
            return [dict(r) for r in rows]

    def add_metrics(self, records: list[dict]) -> int:
        """Insert per-(step, rank) records, ignoring ones already stored; returns new."""
        now = time.time()  # when the service first had it: metric latency = received - time
        rows = [(r["job_id"], int(r["step"]), int(r["rank"]), json.dumps({**r, "received": now}))
                for r in records]
        with self._lock, self._connect() as db:
            before = db.total_changes
            db.executemany("INSERT OR IGNORE INTO metrics VALUES (?, ?, ?, ?)", rows)
            return db.total_changes - before

    def metrics(self, job_id: str, after_step: int = 0) -> list[dict]:
        with self._connect() as db:
            rows = db.execute("SELECT record FROM metrics WHERE job_id = ? AND step > ? "
                              "ORDER BY step, rank", (job_id, after_step)).fetchall()
            return [json.loads(r["record"]) for r in rows]

    def metrics_after_row(self, job_id: str, row: int) -> list[tuple[int, dict]]:
        """(row id, record) in arrival order after ``row``: an event stream's cursor that
        no late rank of an earlier step can slip past."""
        with self._connect() as db:
            rows = db.execute("SELECT rowid, record FROM metrics WHERE job_id = ? AND "
                              "rowid > ? ORDER BY rowid", (job_id, row)).fetchall()
            return [(r["rowid"], json.loads(r["record"])) for r in rows]

    def counts(self) -> dict[str, int]:
        with self._connect() as db:
            rows = db.execute("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")
            return {**dict.fromkeys(STATES, 0), **{r["status"]: r["n"] for r in rows}}

    @staticmethod
    def _job(row: sqlite3.Row) -> dict:
        job = dict(row)
        job["spec"] = json.loads(job["spec"])
        job["plan"] = json.loads(job["plan"]) if job["plan"] else None
        job["dry_run"] = bool(job["dry_run"])
        return job
