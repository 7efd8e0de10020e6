"""Experiment tracking on the Ray Train controller: per-step scalars from the records
that feed ``metrics.jsonl`` and the store, written by one writer per job.

``TrackingCallback`` is a Ray Train ``UserCallback`` placed after the entrypoint's
``MetricsCallback``: it gets the same list of per-rank records. ``StepAggregator``
buffers them by step and hands a step's scalars to every sink once all ``world_size``
ranks' records for that step have arrived; a step is written once (the first complete
set, as the store keeps the first record of a (job, step, rank)), so the steps a
restarted worker group reports again are not drawn twice.

Sinks: ``TensorBoardSink`` (tensorboardX's event writer, locked) under
``<job_dir>/tensorboard/``, on unless the spec says ``metrics: {tensorboard: false}``.
Weights & Biases and MLflow are not installed here (neither is in requirements.lock):
a sink for either is a class with ``log(step, scalars, walltime)`` and ``close()``
(``wandb.log(scalars, step=step)``, ``mlflow.log_metrics(scalars, step=step)``), added
in ``sinks_for`` when its package imports and its own environment configures it
(``WANDB_*``, ``MLFLOW_TRACKING_URI``): credentials stay in the environment, never in
the spec or the logs.
"""

from __future__ import annotations

import atexit
import os
import time
import uuid
from statistics import fmean

from ray.train.v2.api.callback import UserCallback

TENSORBOARD_DIR = "tensorboard"


def step_scalars(records: list[dict]) -> dict[str, float]:
    """One step's scalars from every rank's record of it: ``loss`` (mean over ranks) and
    ``loss/rank_R``; ``lr/GROUP`` and ``grad_norm`` (global figures, from the lowest
    rank); ``tokens_per_s_total`` (all ranks' tokens over the slowest rank's step time,
    the lowest of the ranks' figures) and ``step_time_s`` (the slowest rank's); ``mfu``
    (mean) and ``val_loss`` and ``skipped_steps`` where the records carry them."""
    ranks = sorted(records, key=lambda r: r["rank"])
    first = ranks[0]
    losses = {r["rank"]: r["loss"] for r in ranks if r.get("loss") is not None}
    out = {"loss": fmean(losses.values())} if losses else {}
    out.update({f"loss/rank_{rank}": loss for rank, loss in losses.items()})
    out.update({f"lr/{group}": lr for group, lr in (first.get("lr") or {}).items()})
    for key in ("grad_norm", "val_loss", "skipped_steps"):
        if first.get(key) is not None:
            out[key] = first[key]
    if all(r.get("tokens_per_s_total") is not None for r in ranks):
        out["tokens_per_s_total"] = min(r["tokens_per_s_total"] for r in ranks)
    if all(r.get("step_time_s") is not None for r in ranks):
        out["step_time_s"] = max(r["step_time_s"] for r in ranks)
    if all(r.get("mfu") is not None for r in ranks):
        out["mfu"] = fmean(r["mfu"] for r in ranks)
    return {k: float(v) for k, v in out.items()}


class StepAggregator:
    """Buffers per-rank records by step; a complete step goes to the sinks once."""

    def __init__(self, world_size: int, sinks: list):
        self.world_size, self.sinks = world_size, sinks
        self.pending: dict[int, dict[int, dict]] = {}
        self.written: set[int] = set()

    def add(self, records: list[dict]) -> list[int]:
        """Take records (any ranks, any steps); returns the steps written now."""
        done = []
        for rec in records:
            step = rec["step"]
            if step in self.written:
                continue
            ranks = self.pending.setdefault(step, {})
            ranks[rec["rank"]] = rec
            if len(ranks) == self.world_size:
                del self.pending[step]
                self.written.add(step)
                done.append(step)
                self._log(step, list(ranks.values()))
        for sink in self.sinks:
            sink.flush()
        return done

    def _log(self, step: int, records: list[dict]) -> None:
        scalars = step_scalars(records)
        walltime = max((r["time"] for r in records if r.get("time") is not None),
                       default=None)
        for sink in self.sinks:
            sink.log(step, scalars, walltime)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class TensorBoardSink:
    """One event file under ``log_dir``, written synchronously with tensorboardX's
    ``EventsWriter`` (its ``SummaryWriter`` queues events for a thread that flushes
    every ``flush_secs``: a step could sit unwritten in a process that ends abruptly).
    After ``flush`` every step logged is on disk. The file's name carries the process
    and a random tag, so a second writer in the same second never truncates it."""

    def __init__(self, log_dir: str):
        from tensorboardX.event_file_writer import EventsWriter

        os.makedirs(log_dir, exist_ok=True)
        self.writer = EventsWriter(os.path.join(log_dir, "events"),
                                   f".{os.getpid()}.{uuid.uuid4().hex[:8]}")
        self.closed = False

    def log(self, step: int, scalars: dict[str, float], walltime: float | None) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        if self.closed:
            return
        wall = time.time() if walltime is None else walltime
        for tag, value in scalars.items():
            self.writer.write_event(Event(wall_time=wall, step=step,
                                          summary=scalar(tag, value)))

    def flush(self) -> None:
        if not self.closed:
            self.writer.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


def sinks_for(job_dir: str, tensorboard: bool = True) -> list:
    """The job's sinks (the extension point for W&B and MLflow: see the module doc)."""
    return [TensorBoardSink(os.path.join(job_dir, TENSORBOARD_DIR))] if tensorboard else []


class TrackingCallback(UserCallback):
    """On the Ray Train controller, after ``MetricsCallback``: the sinks open there on
    the first report (nothing is pickled open), are flushed after every report (a
    complete step is on disk before the next report), and close on the final step, on
    a worker failure's flush, or at the controller's exit."""

    def __init__(self, job_dir: str, world_size: int, final_step: int,
                 tensorboard: bool = True):
        self.job_dir, self.world_size, self.final_step = job_dir, world_size, final_step
        self.tensorboard = tensorboard
        self.aggregator: StepAggregator | None = None

    def _open(self) -> StepAggregator:
        if self.aggregator is None:
            self.aggregator = StepAggregator(self.world_size,
                                             sinks_for(self.job_dir, self.tensorboard))
            atexit.register(self.aggregator.close)
        return self.aggregator

    def after_report(self, run_context, metrics, checkpoint):
        aggregator = self._open()
        if self.final_step in aggregator.add(list(metrics)):
            aggregator.close()

    def after_exception(self, run_context, worker_exceptions):
        if self.aggregator is not None:  # a restarted group reports on; keep it open
            for sink in self.aggregator.sinks:
                sink.flush()


def callbacks(spec, job_dir: str, world_size: int, export_only: bool = False) -> list:
    """The tracking callbacks for a training job (none for an export, none when the spec
    turns every sink off)."""
    tensorboard = getattr(spec.metrics, "tensorboard", True)
    if export_only or not tensorboard:
        return []
    return [TrackingCallback(job_dir, world_size, spec.steps, tensorboard=tensorboard)]
