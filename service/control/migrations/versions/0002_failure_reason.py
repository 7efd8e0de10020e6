"""Why a job failed: ``jobs.reason``, the first exception on the first failing rank as
JSON (type, message, rank, step, phase, frames, source, time); NULL for older jobs.

Revision ID: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:  # SQLite drops a column by copying
        batch.drop_column("reason")
