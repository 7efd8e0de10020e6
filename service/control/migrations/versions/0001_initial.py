"""The first schema: jobs, status history, metrics, locks.

Revision ID: 0001
"""

from __future__ import annotations

from alembic import op
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

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# the tables as this revision made them, frozen here: later columns come from later
# revisions (op.add_column, ...), which must never import the live schema either
_meta = MetaData()
_Serial = BigInteger().with_variant(Integer, "sqlite")
jobs = Table(
    "jobs", _meta,
    Column("id", String(64), primary_key=True),
    Column("name", String(256), nullable=False),
    Column("spec", Text, nullable=False),
    Column("plan", Text),
    Column("status", String(16), nullable=False),
    Column("dry_run", Boolean, nullable=False),
    Column("idempotency_key", String(256), unique=True),
    Column("message", Text),
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
    "status_history", _meta,
    Column("id", _Serial, primary_key=True, autoincrement=True),
    Column("job_id", String(64), nullable=False, index=True),
    Column("status", String(16), nullable=False),
    Column("time", Float, nullable=False),
    Column("message", Text),
)
metrics = Table(
    "metrics", _meta,
    Column("id", _Serial, primary_key=True, autoincrement=True),
    Column("job_id", String(64), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("record", Text, nullable=False),
    Column("received", Float, nullable=False),
    Column("source", String(8), nullable=False),
    UniqueConstraint("job_id", "step", "rank", name="metrics_job_step_rank"),
    Index("metrics_job_id", "job_id", "id"),
)
locks = Table(
    "locks", _meta,
    Column("name", String(32), primary_key=True),
    Column("n", BigInteger, nullable=False),
)


def upgrade() -> None:
    bind = op.get_bind()
    for table in (jobs, status_history, metrics, locks):
        table.create(bind)
    op.bulk_insert(locks, [{"name": "queue", "n": 0}])


def downgrade() -> None:
    for name in ("locks", "metrics", "status_history", "jobs"):
        op.drop_table(name)
