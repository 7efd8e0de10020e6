"""Per-rank step records: their schema, and the one way into the store.

A job posts each step's records (the fast channel) and appends them to
``<storage>/<job>/metrics.jsonl`` first (the durable one); both go through ``ingest``.
Non-finite numbers (a diverging job's ``loss: NaN``) are kept as ``null`` with their
names under ``nonfinite``, so every stored record is valid JSON.
"""

from __future__ import annotations

import json
import math
import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.job.job_dir import METRICS, RANK_RECORDS
from service.job.spec import field_path, text

from .store import JobStore

MAX_RECORDS = 1000  # per request
MAX_STEP = 1 << 40
Count = Annotated[int, Field(ge=0, le=1 << 62)]
Schedule = Literal["1f1b", "interleaved", "gpipe"]  # a Layout's pp_schedule
Number = float | None


class LayoutEvent(BaseModel):
    """A start of the job's worker group (``service.worker.layout_events``): the first, or a
    resize or restart, with the layout before and after and the steps it lost."""

    model_config = ConfigDict(extra="forbid", strict=True)

    reason: text(256, 1)
    # R x N, R x N x T under tensor parallelism, pp x R x N (x T) under pipelines
    previous: tuple[Count, ...] | None = Field(None, strict=False, min_length=2, max_length=4)
    layout: tuple[Count, ...] = Field(strict=False, min_length=2, max_length=4)
    resumed_from: Count
    steps_lost: Count


class StepRecord(BaseModel):
    """One rank's figures for one step, as ``service.worker`` reports them."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=True)

    job_id: text(64, 1)
    step: int = Field(ge=0, le=MAX_STEP)
    rank: int = Field(ge=0, le=1 << 20)
    loss: Number = None
    val_loss: Number = None
    step_time_s: Number = None
    tokens_per_s: Number = None  # this rank's
    tokens_per_s_total: Number = None  # every rank's tokens over this rank's step time
    mfu: Number = None  # model FLOPs utilisation against the spec's (or the GPU's) peak
    grad_norm: Number = None  # before clipping
    max_logit: Number = None  # QK-clip: the step's largest max logit of any head
    clipped_heads: Count | None = None  # QK-clip: heads whose q/k rows were scaled
    skipped: bool = False  # this step's update skipped: a gradient was not finite
    skipped_steps: Count = 0  # steps skipped so far in this run
    nonfinite_ranks: list[Count | Literal["fsdp2", "update"]] = Field(
        default_factory=list, max_length=1 << 16)
    lr: dict[text(16), Number] = Field(default_factory=dict, max_length=8)  # per group kind
    bytes: dict[text(64), Count | float] = Field(default_factory=dict, max_length=64)
    memory: dict[text(64), Count] = Field(default_factory=dict, max_length=64)  # after it
    # within the step: packed_buffers' high-water mark, a GPU's peak allocated bytes
    peak_memory: dict[text(64), Count | None] = Field(default_factory=dict, max_length=8)
    rss_bytes: Count | None = None
    time: Number = None
    # (r, s), (r, s, t) under tensor parallelism, (p, r, s[, t]) under pipelines
    coord: tuple[Count, ...] | None = Field(None, strict=False, min_length=2, max_length=4)
    # ([pp x] R x N (x T) of this run
    layout: tuple[Count, ...] | None = Field(None, strict=False, min_length=2, max_length=4)
    # the whole service.job.layout.Layout this rank ran (degrees, hosts, batch split,
    # pipeline schedule)
    ran_layout: dict[text(32), Count | Schedule | None] | None = Field(None, max_length=16)
    # a pipeline-parallel job's: per stage this rank ran (by index), its layers [lo, hi)
    # and its partition's digest, and torch's schedule class it ran
    stage_layers: dict[text(8), Annotated[list[Count], Field(min_length=2, max_length=2)]] \
        | None = Field(None, max_length=64)
    stage_digests: dict[text(8), text(16)] | None = Field(None, max_length=64)
    schedule: text(64) | None = None
    layout_event: LayoutEvent | None = None  # rank 0's first record of a run
    resumed_from: Count | None = None
    capacity: Count | None = None  # workers Ray Train could start now (an elastic job's)
    partition_digest: text(16) | None = None  # of the partition this rank runs
    node_id: text(128) | None = None
    node_ip: text(64) | None = None

    def canonical(self) -> str:
        """Sorted-key JSON with non-finite numbers as null (named under ``nonfinite``):
        equal records give equal text, which is how the spool recognises its own."""
        data = self.model_dump()
        bad = [k for k, v in data.items() if _nonfinite(v)]
        bad += [f"{group}.{k}" for group in ("bytes", "lr") for k, v in data[group].items()
                if _nonfinite(v)]
        for name in bad:
            group, _, key = name.rpartition(".")
            (data[group] if group else data)[key] = None
        if bad:
            data["nonfinite"] = bad
        return json.dumps(data, sort_keys=True, allow_nan=False)


def _nonfinite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


Records = Annotated[list[StepRecord], Field(max_length=MAX_RECORDS)]


def ingest(store: JobStore, job_id: str, records: list[StepRecord], source: str) -> int:
    """Into the store: posts and the ranks' own records (``source`` ``post``, ``rank``:
    at most 8 characters) never replace a record, the job's spool corrects one."""
    rows = [(r.step, r.rank, r.canonical()) for r in records]
    return store.records.add(job_id, rows, source, authoritative=source == "spool")


def read_spool(store: JobStore, job_id: str, path: str, offset: int) -> tuple[int, list[str]]:
    """Ingest the complete lines of ``path`` after ``offset``; returns (records stored,
    problems). A malformed line is reported and skipped; the lines around it are kept,
    and the offset advances only past what was read whole."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            chunk = fh.read()
    except FileNotFoundError:
        return 0, []
    complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
    records, problems = [], []
    for number, line in enumerate(complete.splitlines()):
        if not line.strip():
            continue
        try:
            records.append(StepRecord.model_validate(json.loads(line)))
        except (ValueError, ValidationError) as e:
            problems.append(f"{path}: line {number + 1} after byte {offset}: {_reason(e)}")
    stored = ingest(store, job_id, [r for r in records if r.job_id == job_id], "spool")
    if complete:
        store.queue.advance_spool(job_id, offset + len(complete))
    return stored, problems


def read_rank_records(store: JobStore, job_id: str, job_dir: str) -> tuple[int, list[str]]:
    """Ingest the records the ranks kept of every step they ran, where the store lacks
    them (a job stopped while its last reports were still on their way to the spool);
    never replacing a stored one. A step is taken once every rank of the layout it ran
    on kept it (a job stopped mid-write leaves its last step to the spool, if any).
    Returns (records stored, problems)."""
    folder = os.path.join(job_dir, RANK_RECORDS)
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".jsonl"))
    except FileNotFoundError:
        return 0, []
    records, problems = [], []
    for name in names:
        with open(os.path.join(folder, name), "rb") as fh:
            text = fh.read()
        for number, line in enumerate(text[:text.rfind(b"\n") + 1].splitlines()):
            try:
                records.append(StepRecord.model_validate({**json.loads(line),
                                                          "job_id": job_id}))
            except (ValueError, TypeError, ValidationError) as e:
                problems.append(f"{folder}/{name}: line {number + 1}: {_reason(e)}")
    return ingest(store, job_id, _complete_steps(records), "rank"), problems


def _complete_steps(records: list[StepRecord]) -> list[StepRecord]:
    """The records of the steps every rank of their layout kept (a record without a
    layout counts as complete)."""
    ranks: dict[tuple, set[int]] = {}
    for r in records:
        ranks.setdefault((r.step, r.layout), set()).add(r.rank)
    return [r for r in records
            if r.layout is None or len(ranks[r.step, r.layout]) == math.prod(r.layout)]


def _reason(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{field_path(x['loc'])}: {x['msg']}" for x in e.errors())
    return str(e)


def spool_path(storage: str, job_id: str) -> str:
    return os.path.join(storage, job_id, METRICS)
