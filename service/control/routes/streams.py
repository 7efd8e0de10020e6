"""Streams that follow a job: its metrics and status as server-sent events, and its
driver's output."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent

from ..auth import JobId, guarded
from ..sql_tables import TERMINAL

MAX_CURSOR = 1 << 62
MAX_TAIL_LINES = 100_000
reads = APIRouter(route_class=guarded("read"), tags=["streams"])
admin = APIRouter(route_class=guarded("admin"), tags=["streams"])


def _existing(job_id: JobId, request: Request) -> str:
    if request.app.state.store.job_status(job_id) is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job_id


@reads.get("/v1/jobs/{job_id}/events", response_class=EventSourceResponse)
async def events(request: Request, job_id: Annotated[str, Depends(_existing)],
                 poll_s: float = Query(0.5, ge=0.05, le=10),
                 last_event_id: Annotated[int, Header(ge=0, le=MAX_CURSOR)] = 0):
    """``metrics`` events (one per record; ``id`` is its position, so a client that
    reconnects with ``Last-Event-ID`` misses nothing) and ``status`` events, until the
    job has ended and every record was sent."""
    store, cursor, status = request.app.state.store, last_event_id, None
    while True:
        fresh = await asyncio.to_thread(store.records.after, job_id, cursor)
        for cursor, record in fresh:  # noqa: B007 - the cursor moves past each record
            yield ServerSentEvent(data=record, event="metrics", id=str(cursor))
        current = await asyncio.to_thread(store.job_status, job_id)
        if current != status:
            status = current
            yield ServerSentEvent(data=await _status_event(store, job_id, status),
                                  event="status")
        if status in TERMINAL and not fresh:
            return
        if not fresh:
            await asyncio.sleep(poll_s)


async def _status_event(store, job_id: str, status: str) -> dict:
    """``{"status"}``; a FAILED job's also carries ``reason`` and ``message``."""
    if status != "FAILED":
        return {"status": status}
    reason, message = await asyncio.to_thread(store.failure, job_id)
    return {"status": status, "reason": reason, "message": message}


@admin.get("/v1/jobs/{job_id}/logs")
def logs(request: Request, job_id: Annotated[str, Depends(_existing)], follow: bool = False,
         tail: int | None = Query(None, ge=1, le=MAX_TAIL_LINES)):
    """The job driver's output; ``tail=N`` its last N lines (the dashboard's log view);
    ``follow=true`` streams it until the job ends."""
    if follow and tail is not None:
        raise HTTPException(422, [{"field": "query.tail", "message": "tail is for a read of "
                                   "the log; follow=true streams all of it"}])
    state = request.app.state
    job = state.store.job_view(job_id)
    runner = state.runner
    if runner is None or job["dry_run"] or len(job["history"]) < 2 and \
            job["status"] == "PENDING":
        return PlainTextResponse("")
    if follow:
        return StreamingResponse(runner.tail(job_id), media_type="text/plain")
    text = runner.logs(job_id)
    return PlainTextResponse(text if tail is None else last_lines(text, tail))


def last_lines(text: str, n: int) -> str:
    """The last ``n`` lines, split at newlines only (a progress bar's carriage returns
    stay inside its line)."""
    start = len(text) - text.endswith("\n")
    for _ in range(n):
        start = text.rfind("\n", 0, start)
        if start < 0:
            return text
    return text[start + 1:]
