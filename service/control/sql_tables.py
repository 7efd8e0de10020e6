"""The job store's tables (SQLAlchemy Core). Alembic's migrations create them; this is
what the store's queries are written against."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

STATES = ("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# where a job stands with Ray, apart from its status: not yet handed over (NULL),
# claimed by one replica that is submitting it, submitted, or settled (Ray says it ended)
CLAIMED, SUBMITTED, SETTLED = "claimed", "submitted", "settled"

metadata = MetaData()

# SQLite's INTEGER PRIMARY KEY is its rowid (autoincrementing); PostgreSQL needs BIGINT
Serial = BigInteger().with_variant(Integer, "sqlite")

jobs = Table(
    "jobs", metadata,
    Column("id", String(64), primary_key=True),
    Column("name", String(256), nullable=False),
    Column("spec", Text, nullable=False),
    Column("plan", Text),
    Column("status", String(16), nullable=False),
    Column("dry_run", Boolean, nullable=False),
    Column("idempotency_key", String(256), unique=True),
    Column("message", Text),
    # why a FAILED job failed: JSON {type, message, rank, step, phase, frames, source,
    # time} (service/job/failure.py), NULL when no exception is known (migration 0002)
    Column("reason", Text),
    Column("created", Float, nullable=False),
    Column("updated", Float, nullable=False),
    Column("ray", String(16)),
    Column("claimed_at", Float),
    Column("job_token_hash", String(64)),
    Column("spool_offset", BigInteger, nullable=False, server_default="0"),
    Index("jobs_status_created", "status", "created"),
    Index("jobs_created", "created"),
)

status_history = Table(
    "status_history", metadata,
    Column("id", Serial, primary_key=True, autoincrement=True),
    Column("job_id", String(64), nullable=False, index=True),
    Column("status", String(16), nullable=False),
    Column("time", Float, nullable=False),
    Column("message", Text),
)

# ``id`` is the event streams' cursor: a corrected record is deleted and inserted again,
# so a stream sends it once more
metrics = Table(
    "metrics", metadata,
    Column("id", Serial, primary_key=True, autoincrement=True),
    Column("job_id", String(64), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("record", Text, nullable=False),
    Column("received", Float, nullable=False),
    Column("source", String(8), nullable=False),
    UniqueConstraint("job_id", "step", "rank", name="metrics_job_step_rank"),
    Index("metrics_job_id", "job_id", "id"),
)

# one row per lock name: the queue's claims take it (UPDATE = a row lock on PostgreSQL,
# the database's write lock on SQLite), so max_running holds across replicas
locks = Table(
    "locks", metadata,
    Column("name", String(32), primary_key=True),
    Column("n", BigInteger, nullable=False),
)
