"""Alembic's environment: migrate the connection the store hands over (see
``service.control.migrate``), or the URL of ``alembic -x url=...``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

connection = context.config.attributes.get("connection")


def _run(conn) -> None:
    context.configure(connection=conn, target_metadata=None, transaction_per_migration=False)
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:
    with create_engine(context.get_x_argument(as_dictionary=True)["url"]).connect() as conn:
        _run(conn)
