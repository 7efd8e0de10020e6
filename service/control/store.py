"""The job store: jobs, specs, plans, status history and per-rank metrics, on SQLAlchemy.

SQLite (one file, WAL, pooled connections) is the embedded default; PostgreSQL serves
several replicas on one database. Every state change is a compare-and-set in one
transaction, and the queue's claims take the ``locks`` row of the queue, so idempotency,
``max_running`` and cancellation hold across processes, not only across threads.
"""

from __future__ import annotations

import json
import time
import uuid

from sqlalchemy import Engine, create_engine, event, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError

from .metric_rows import MetricRows, last_validation
from .migrate import upgrade
from .ray_queue import ON_RAY, RayQueue
from .sql_tables import STATES, SUBMITTED, jobs, locks, metrics
from .sql_tables import status_history as history_table
from .status_moves import move_status


class StoreError(RuntimeError):
    """The database cannot be opened or written; the message names it and says why."""


def _sqlite_engine(url: str, begin: str) -> Engine:
    engine = create_engine(url, pool_size=8, max_overflow=56, pool_timeout=60,
                           connect_args={"timeout": 30, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _connect(dbapi, _record):
        dbapi.isolation_level = None  # the "begin" listener below opens transactions
        dbapi.execute("PRAGMA busy_timeout = 30000")
        dbapi.execute("PRAGMA journal_mode = WAL")  # readers never wait for the writer
        dbapi.execute("PRAGMA synchronous = NORMAL")  # durable with WAL at commit points

    @event.listens_for(engine, "begin")
    def _begin(conn):
        conn.exec_driver_sql(begin)

    return engine


def _engines(url: str) -> tuple[Engine, Engine]:
    """(reader, writer). On SQLite a writer begins IMMEDIATE: it takes the write lock
    first, so two writers never both read and then fail to upgrade; readers stay
    concurrent under WAL."""
    if url.startswith("sqlite"):
        return _sqlite_engine(url, "BEGIN"), _sqlite_engine(url, "BEGIN IMMEDIATE")
    engine = create_engine(url, pool_size=16, max_overflow=48, pool_pre_ping=True)
    return engine, engine


def _job(row) -> dict:
    """A row as the API shows it (a row read without its plan has none)."""
    job = dict(row._mapping)
    job["spec"] = json.loads(job["spec"])
    if "reason" in job:
        job["reason"] = json.loads(job["reason"]) if job["reason"] else None
    if "plan" in job:
        job["plan"] = json.loads(job["plan"]) if job["plan"] else None
    for private in ("job_token_hash", "spool_offset", "claimed_at", "ray"):
        job.pop(private, None)
    return job


def _history(conn, job_id: str) -> list[dict]:
    h = history_table.c
    rows = conn.execute(select(h.status, h.time, h.message).where(h.job_id == job_id)
                        .order_by(h.id)).all()
    return [dict(r._mapping) for r in rows]


def _layout_events(conn, job_id: str) -> list[dict]:
    """The layout changes rank 0 recorded (an elastic job's), with their steps."""
    events = conn.execute(select(metrics.c.record).where(
        metrics.c.job_id == job_id, metrics.c.rank == 0,
        metrics.c.record.like('%"layout_event": {%')).order_by(metrics.c.step)).all()
    return [{"step": r["step"], **r["layout_event"]}
            for r in (json.loads(text) for (text,) in events)]


def _last_losses(conn, job_id: str) -> dict | None:
    """The newest step's loss (the mean over its ranks, as the step line shows it) and
    the newest validation loss, each with its step; None before the first step."""
    m = metrics.c
    step = conn.execute(select(func.max(m.step)).where(m.job_id == job_id)).scalar()
    if step is None:
        return None
    losses = [json.loads(t).get("loss") for (t,) in conn.execute(
        select(m.record).where(m.job_id == job_id, m.step == step))]
    numbers = [v for v in losses if isinstance(v, (int, float))]
    out = {"step": step, "loss": sum(numbers) / len(numbers)
           if numbers and len(numbers) == len(losses) else None}
    record = last_validation(conn, job_id)
    if record is not None:
        out.update(val_step=record["step"], val_loss=record.get("val_loss"))
    return out


class JobStore:
    def __init__(self, url: str):
        self.url = url
        self.reader, self.writer = _engines(url)
        try:
            with self.writer.begin() as conn:
                upgrade(conn)
                # a store that opens but cannot be written fails here, not on a request
                conn.execute(update(locks).where(locks.c.name == "queue")
                             .values(n=locks.c.n))
        except DBAPIError as e:
            self.close()
            raise StoreError(f"cannot use the job store {self.display_url()}: "
                             f"{e.orig or e}") from None
        self.records = MetricRows(self.reader, self.writer, self._insert)
        self.queue = RayQueue(self)

    def display_url(self) -> str:
        return self.reader.url.render_as_string(hide_password=True)

    def close(self) -> None:
        self.reader.dispose()
        self.writer.dispose()

    def _insert(self, table):
        dialect = self.writer.dialect.name
        return (pg_insert if dialect == "postgresql" else sqlite_insert)(table)

    # -- jobs ----------------------------------------------------------------------------
    def create_job(self, name: str, spec: dict, *, dry_run: bool, plan: dict | None,
                   idempotency_key: str | None = None, status: str = "PENDING",
                   message: str | None = None) -> tuple[dict, bool]:
        """(job, created): a new job, or the one an earlier request with the same key
        made (whichever replica made it)."""
        now, job_id = time.time(), f"dmuon-{uuid.uuid4().hex[:12]}"
        row = {"id": job_id, "name": name, "spec": json.dumps(spec), "status": status,
               "dry_run": dry_run, "idempotency_key": idempotency_key or None,
               "plan": json.dumps(plan) if plan is not None else None, "created": now,
               "updated": now, "message": message}
        with self.writer.begin() as conn:
            stmt = self._insert(jobs).values(**row)
            if idempotency_key:
                stmt = stmt.on_conflict_do_nothing(index_elements=["idempotency_key"])
            # RETURNING, not rowcount: drivers disagree about rowcount for INSERT
            created = conn.execute(stmt.returning(jobs.c.id)).first() is not None
            if created:
                conn.execute(insert(history_table).values(job_id=job_id, status=status,
                                                          time=now, message=message))
            else:
                job_id = conn.execute(select(jobs.c.id).where(
                    jobs.c.idempotency_key == idempotency_key)).scalar_one()
        return self.get_job(job_id), created

    def register_job(self, job_id: str, name: str, spec: dict, plan: dict,
                     token_hash: str) -> dict | None:
        """A job Ray already runs (started with ``ray job submit``), stored RUNNING under
        its submission id and followed as submitted; None if that id is taken."""
        now, message = time.time(), "registered by its entrypoint (ray job submit)"
        row = {"id": job_id, "name": name, "spec": json.dumps(spec), "status": "RUNNING",
               "dry_run": False, "plan": json.dumps(plan), "created": now, "updated": now,
               "ray": SUBMITTED, "job_token_hash": token_hash}
        with self.writer.begin() as conn:
            stmt = self._insert(jobs).values(**row).on_conflict_do_nothing(
                index_elements=["id"]).returning(jobs.c.id)
            if conn.execute(stmt).first() is None:
                return None
            conn.execute(insert(history_table).values(job_id=job_id, status="RUNNING",
                                                      time=now, message=message))
        return self.get_job(job_id)

    def get_job(self, job_id: str) -> dict | None:
        with self.reader.connect() as conn:
            row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
        return _job(row) if row else None

    def complete_plan(self, job_id: str, deferred: dict, plan: dict) -> bool:
        """Store the plan a job's entrypoint completed in place of the deferred one it
        was given; False if the stored plan is no longer ``deferred``."""
        with self.writer.begin() as conn:
            return conn.execute(
                update(jobs).where(jobs.c.id == job_id, jobs.c.plan == json.dumps(deferred))
                .values(plan=json.dumps(plan))).rowcount == 1

    def job_view(self, job_id: str) -> dict | None:
        """A job without its plan, with its status history: one read, one connection."""
        cols = [c for c in jobs.c if c.name != "plan"]
        with self.reader.connect() as conn:
            row = conn.execute(select(*cols).where(jobs.c.id == job_id)).first()
            if row is None:
                return None
            history = _history(conn, job_id)
            last = _last_losses(conn, job_id)
            layouts = _layout_events(conn, job_id)
        return {**_job(row), "history": history, "layouts": layouts,
                **({"last": last} if last is not None else {})}

    def list_jobs(self, status: str | None = None, limit: int = 1000) -> list[dict]:
        cols = [c for c in jobs.c if c.name != "plan"]
        query = select(*cols).order_by(jobs.c.created.desc()).limit(limit)
        if status:
            query = query.where(jobs.c.status == status)
        with self.reader.connect() as conn:
            rows = conn.execute(query).all()
        return [_job(r) for r in rows]

    def history(self, job_id: str) -> list[dict]:
        with self.reader.connect() as conn:
            return _history(conn, job_id)

    def counts(self) -> dict[str, int]:
        with self.reader.connect() as conn:
            rows = conn.execute(select(jobs.c.status, func.count()).group_by(jobs.c.status))
            return {**dict.fromkeys(STATES, 0), **{s: n for s, n in rows}}

    # -- status changes (compare-and-set) --------------------------------------------------
    def set_status(self, job_id: str, status: str, message: str | None = None) -> bool:
        if status not in STATES:
            raise ValueError(f"unknown status {status!r}")
        with self.writer.begin() as conn:
            return move_status(conn, job_id, status, message)

    def cancel(self, job_id: str) -> tuple[dict | None, bool]:
        """(job, on_ray): the job STOPPED unless it had ended; ``on_ray`` when Ray may
        hold it (claimed or submitted), so the caller stops it there too. A runner that
        submits meanwhile finds the job STOPPED when it marks it RUNNING, and stops it."""
        with self.writer.begin() as conn:
            query = select(jobs.c.ray).where(jobs.c.id == job_id)
            if conn.dialect.name == "postgresql":
                query = query.with_for_update()
            row = conn.execute(query).first()
            if row is None:
                return None, False
            move_status(conn, job_id, "STOPPED", "cancelled")
        return self.get_job(job_id), row.ray in ON_RAY

    def failure(self, job_id: str) -> tuple[dict | None, str | None]:
        """(reason, message) of a job: why it failed, when that is known."""
        with self.reader.connect() as conn:
            row = conn.execute(select(jobs.c.reason, jobs.c.message)
                               .where(jobs.c.id == job_id)).first()
        if row is None:
            return None, None
        return (json.loads(row.reason) if row.reason else None), row.message

    def job_status(self, job_id: str) -> str | None:
        with self.reader.connect() as conn:
            return conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar()
