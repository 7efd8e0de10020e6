"""The first schema: jobs, status history, metrics, locks.

Revision ID: 0001
"""

from __future__ import annotations

from alembic import op

# the first revision creates the tables as schema.py first defined them; later revisions
# must spell out their own operations (op.add_column, ...), never import the live schema
from service.api.schema import jobs, locks, metrics, status_history

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    bind = op.get_bind()
    for table in (jobs, status_history, metrics, locks):
        table.create(bind)
    op.bulk_insert(locks, [{"name": "queue", "n": 0}])


def downgrade() -> None:
    for name in ("locks", "metrics", "status_history", "jobs"):
        op.drop_table(name)
