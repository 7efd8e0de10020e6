"""The layouts a job's worker group has run, one line per start in
``<job>/layouts.jsonl`` (written by rank 0, on the job's shared storage): each start is
a layout event (its reason, the layout before and after, the checkpoint resumed and the
steps lost since it), carried by rank 0's first step record to the control plane."""

from __future__ import annotations

import json
import math
import os
import time

from service.job.job_dir import LAYOUTS as LAYOUTS_FILE
from service.job.job_dir import METRICS as SPOOL_FILE


def last_step(spool: str) -> int | None:
    """The step of the job spool's last record (None before the first)."""
    try:
        with open(spool, "rb") as fh:
            fh.seek(max(0, os.path.getsize(spool) - 65536))  # a record is far shorter
            lines = fh.read().splitlines()
    except OSError:
        return None
    return json.loads(lines[-1])["step"] if lines else None


def last_layout(job_dir: str) -> list[int] | None:
    """[R, N] of the job's newest start (None before its first)."""
    try:
        with open(os.path.join(job_dir, LAYOUTS_FILE)) as fh:
            lines = [line for line in fh if line.strip()]
    except FileNotFoundError:
        return None
    return json.loads(lines[-1])["layout"] if lines else None


def _reason(previous: list[int], layout: list[int]) -> str:
    before, now = math.prod(previous), math.prod(layout)
    if now < before:
        return f"capacity lost: {before} -> {now} workers (a node or worker failed)"
    if now > before:
        return f"capacity returned: {before} -> {now} workers"
    return f"restarted on the same {now} workers after a failure"


def start_event(job_dir: str, layout: list[int], resumed_from: int) -> dict:
    """Append this start to the job's layouts and return its event."""
    path = os.path.join(job_dir, LAYOUTS_FILE)
    try:
        with open(path) as fh:
            starts = [json.loads(line) for line in fh if line.strip()]
    except FileNotFoundError:
        starts = []
    layout = list(layout)
    event = {"reason": "start", "previous": None, "layout": layout,
             "resumed_from": resumed_from, "steps_lost": 0}
    if starts:
        reached = last_step(os.path.join(job_dir, SPOOL_FILE)) or resumed_from
        event.update(reason=_reason(starts[-1]["layout"], layout),
                     previous=starts[-1]["layout"],
                     steps_lost=max(0, reached - resumed_from))
    with open(path, "a") as fh:
        fh.write(json.dumps({**event, "time": time.time()}) + "\n")
    return event
