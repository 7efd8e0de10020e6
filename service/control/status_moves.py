"""A job's status moves: compare-and-set in the caller's transaction, with the move
recorded in the job's history."""

from __future__ import annotations

import json
import time

from sqlalchemy import insert, update

from service.job.failure import strip_ansi

from .sql_tables import TERMINAL, jobs
from .sql_tables import status_history as history_table


def move_status(conn, job_id: str, status: str, message: str | None, *extra,
            reason: dict | None = None) -> bool:
    """``status`` unless the job is terminal (or already there); True if it moved.
    Terminal escape codes (Ray colours its logs) never reach the store."""
    now, message = time.time(), strip_ansi(message)
    values = {"status": status, "message": message, "updated": now}
    if reason is not None:
        values["reason"] = json.dumps(reason)
    moved = conn.execute(
        update(jobs).where(jobs.c.id == job_id, jobs.c.status.not_in(TERMINAL),
                           jobs.c.status != status, *extra)
        .values(**values)).rowcount == 1
    if moved:
        conn.execute(insert(history_table).values(job_id=job_id, status=status, time=now,
                                                  message=message))
    return moved
