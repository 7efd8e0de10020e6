"""Experiment tracking on the Ray Train controller: per-step scalars from the records
that feed ``metrics.jsonl`` and the store, written by one writer per job.

``TrackingCallback`` is one of Ray Train's controller callbacks, after the entrypoint's
``MetricsCallback``: it gets the same list of per-rank records. ``StepAggregator``
buffers them by step and hands a step's scalars to every sink once all ``world_size``
ranks' records for that step have arrived; a step is written once (the first complete
set, as the store keeps the first record of a (job, step, rank)), so the steps a
restarted worker group reports again are not drawn twice. The sinks' runs end with the
job's status, whatever ends it: FINISHED with the final step, FAILED when Ray Train
gives up, KILLED when the run is aborted (a cancel or ``ray job stop``, which the
entrypoint turns into Ray Train's abort, or Ctrl-C) or the controller exits otherwise.

Sinks (``service.driver.tracking_sinks``): TensorBoard event files under
``<job_dir>/tensorboard/`` (on unless the spec says ``metrics: {tensorboard: false}``),
an MLflow run (``metrics.mlflow``) and a W&B run (``metrics.wandb``), each given the same
scalars. A sink that fails is reported on the job's log and dropped; training goes on.
"""

from __future__ import annotations

import atexit
from statistics import fmean

from ray.train.v2._internal.execution.callback import (
    ControllerCallback,
    ReportCallback,
    WorkerGroupCallback,
)

from .tracking_sinks import dropped, sinks_for


def step_scalars(records: list[dict]) -> dict[str, float]:
    """One step's scalars from every rank's record of it: ``loss`` (mean over ranks) and
    ``loss/rank_R``; ``lr/GROUP`` and ``grad_norm`` (global figures, from the lowest
    rank); ``tokens_per_s_total`` (all ranks' tokens over the slowest rank's step time,
    the lowest of the ranks' figures) and ``step_time_s`` (the slowest rank's); ``mfu``
    (mean) and ``val_loss``, ``skipped_steps``, ``max_logit`` and ``clipped_heads`` where
    the records carry them."""
    ranks = sorted(records, key=lambda r: r["rank"])
    first = ranks[0]
    losses = {r["rank"]: r["loss"] for r in ranks if r.get("loss") is not None}
    out = {"loss": fmean(losses.values())} if losses else {}
    out.update({f"loss/rank_{rank}": loss for rank, loss in losses.items()})
    out.update({f"lr/{group}": lr for group, lr in (first.get("lr") or {}).items()})
    for key in ("grad_norm", "val_loss", "skipped_steps", "max_logit", "clipped_heads"):
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
        self.each("could not flush", lambda sink: sink.flush())
        return done

    def _log(self, step: int, records: list[dict]) -> None:
        scalars = step_scalars(records)
        walltime = max((r["time"] for r in records if r.get("time") is not None),
                       default=None)
        self.each(f"could not log step {step}", lambda sink: sink.log(step, scalars,
                                                                       walltime))

    def each(self, what: str, call) -> None:
        """``call(sink)`` for every sink; one that raises is reported and dropped."""
        for sink in list(self.sinks):
            try:
                call(sink)
            except Exception as e:  # any failure of a tool's client
                dropped(sink.name, what, e)
                self.sinks.remove(sink)

    def close(self, status: str = "KILLED") -> None:
        """End every sink's run: ``status`` is FINISHED, FAILED or KILLED (MLflow's
        names); a second close changes nothing."""
        self.each("could not close", lambda sink: sink.close(status))


class TrackingCallback(ReportCallback, WorkerGroupCallback, ControllerCallback):
    """On the Ray Train controller: the sinks open there on the first report (nothing is
    pickled open), are flushed after every report (a complete step is on disk before the
    next report) and on a worker's failure, and close with the job's status: on the final
    step, when the controller finishes (a failure), when the run is aborted, or at the
    controller's exit. Ray Train's internal callback interfaces (2.60): its public
    ``UserCallback`` hears neither of the last two."""

    def __init__(self, spec, job_dir: str, world_size: int):
        self.metrics, self.spec = spec.metrics, spec.model_dump(mode="json")
        self.job_dir, self.world_size, self.final_step = job_dir, world_size, spec.steps
        self.aggregator: StepAggregator | None = None

    def _open(self) -> StepAggregator:
        if self.aggregator is None:
            self.aggregator = StepAggregator(
                self.world_size, sinks_for(self.metrics, self.job_dir, self.spec))
            atexit.register(self.aggregator.close)
        return self.aggregator

    def after_report(self, training_report, metrics):
        aggregator = self._open()
        if self.final_step in aggregator.add(list(metrics)):
            aggregator.close("FINISHED")

    def after_worker_group_poll_status(self, worker_group_status):
        if worker_group_status.errors and self.aggregator is not None:
            # a restarted group reports on: the runs stay open
            self.aggregator.each("could not flush", lambda sink: sink.flush())

    def after_controller_finish(self, result):
        if self.aggregator is not None:
            complete = self.final_step in self.aggregator.written
            self.aggregator.close("FINISHED" if complete else
                                  "FAILED" if result.error else "KILLED")

    def before_controller_abort(self):
        if self.aggregator is not None:
            self.aggregator.close("KILLED")


def callbacks(spec, job_dir: str, world_size: int, export_only: bool = False) -> list:
    """The tracking callbacks for a training job (none for an export, none when the spec
    turns every sink off)."""
    if export_only or not spec.metrics.sinks():
        return []
    return [TrackingCallback(spec, job_dir, world_size)]
