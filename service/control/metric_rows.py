"""Per-rank step records in the job store: one row per (job, step, rank), added from
posts and the job's own spool, read back in step order, as the newest step, or in
arrival order (an event stream's cursor)."""

from __future__ import annotations

import json
import time

from sqlalchemy import and_, delete, func, select

from .sql_tables import metrics


def last_validation(conn, job_id: str) -> dict | None:
    """Rank 0's newest record stored with a validation loss (a number, not null)."""
    m = metrics.c
    text = conn.execute(select(m.record).where(
        m.job_id == job_id, m.rank == 0, m.record.like('%"val_loss": %'),
        m.record.not_like('%"val_loss": null%')).order_by(m.step.desc()).limit(1)).scalar()
    return json.loads(text) if text is not None else None


class MetricRows:
    """The step records of every job (``JobStore.records``)."""

    def __init__(self, reader, writer, insert):
        self.reader, self.writer, self._insert = reader, writer, insert

    def add(self, job_id: str, records: list[tuple[int, int, str]], source: str,
            authoritative: bool) -> int:
        """Store (step, rank, canonical JSON) records; returns how many were new or
        corrected. A post never replaces a stored record; the job's own spool
        (``authoritative``) replaces one that differs, so nothing posted can hide it."""
        if not records:
            return 0
        now, steps = time.time(), [s for s, _, _ in records]
        with self.writer.begin() as conn:
            stored = {(s, r): text for s, r, text in conn.execute(
                select(metrics.c.step, metrics.c.rank, metrics.c.record).where(
                    metrics.c.job_id == job_id, metrics.c.step.between(min(steps),
                                                                         max(steps))))}
            fresh = [(s, r, t) for s, r, t in records if (s, r) not in stored]
            wrong = [(s, r, t) for s, r, t in records
                     if authoritative and stored.get((s, r), t) != t]
            for s, r, _ in wrong:
                conn.execute(delete(metrics).where(and_(
                    metrics.c.job_id == job_id, metrics.c.step == s, metrics.c.rank == r)))
            rows = [{"job_id": job_id, "step": s, "rank": r, "record": t, "received": now,
                     "source": source} for s, r, t in fresh + wrong]
            if not rows:
                return 0
            stmt = self._insert(metrics).on_conflict_do_nothing(
                index_elements=["job_id", "step", "rank"]).returning(metrics.c.id)
            return len(conn.execute(stmt, rows).all())

    def all(self, job_id: str, after_step: int = 0) -> list[dict]:
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(metrics.c.record, metrics.c.received)
                .where(metrics.c.job_id == job_id, metrics.c.step > after_step)
                .order_by(metrics.c.step, metrics.c.rank)).all()
        return [{**json.loads(text), "received": received} for text, received in rows]

    def latest(self, job_id: str) -> list[dict]:
        """Every rank's record of the job's newest step ([] before its first)."""
        with self.reader.connect() as conn:
            step = conn.execute(select(func.max(metrics.c.step))
                                .where(metrics.c.job_id == job_id)).scalar()
            if step is None:
                return []
            rows = conn.execute(select(metrics.c.record).where(
                metrics.c.job_id == job_id, metrics.c.step == step)
                .order_by(metrics.c.rank)).all()
        return [json.loads(text) for (text,) in rows]

    def last_validation(self, job_id: str) -> dict | None:
        """Rank 0's newest record with a validation loss, or None."""
        with self.reader.connect() as conn:
            return last_validation(conn, job_id)

    def after(self, job_id: str, cursor: int, limit: int = 1000):
        """(id, record) in arrival order after ``cursor``: an event stream's position,
        which no late rank of an earlier step can slip past."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(metrics.c.id, metrics.c.record, metrics.c.received)
                .where(metrics.c.job_id == job_id, metrics.c.id > cursor)
                .order_by(metrics.c.id).limit(limit)).all()
        return [(i, {**json.loads(text), "received": received}) for i, text, received in rows]
