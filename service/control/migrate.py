"""Bring a database to the newest schema with Alembic, one replica at a time."""

from __future__ import annotations

import os

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, text

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")
# any constant: every replica takes the same advisory lock before it migrates
_PG_LOCK = 0x646D756F6E


def upgrade(connection: Connection) -> None:
    """Migrate inside the connection's transaction: replicas that start together wait
    for one another (PostgreSQL: an advisory lock; SQLite: the write lock of the
    transaction, which the store begins IMMEDIATE)."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
    config = Config()
    config.set_main_option("script_location", SCRIPTS)
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
