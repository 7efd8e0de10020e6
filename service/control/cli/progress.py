"""``dmuon-svc submit --follow``: a job's start-up phases, then a tqdm bar of its steps
with the loss (averaged over the ranks, as the dashboard and TensorBoard show it) and
the ETA, from the job's event stream.

The phases are what the API shows: the job's status and whether a step record came.
PENDING is *placing* (the service's queue, then Ray's job API); RUNNING before the first
record is *building* (Ray's workers start, build and shard the model and run the first
step); the first step's records end it (*first step*). Each phase change is a log line
with the time since following began, so a log file shows where the first 30-50 s went; on
a terminal a line also counts the seconds of the phase it is in. The ETA counts from the
first step, so start-up time does not skew it."""

from __future__ import annotations

import logging
import math
import queue
import sys
import threading
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .http import ServiceError, job_events, request
from .output import failure_line

log = logging.getLogger("service.control.cli")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# status -> (phase, its log line, the words beside a terminal's seconds counter)
PHASES = {
    "PENDING": ("placing", "queued until the service hands the job to Ray",
                "queued for Ray"),
    "RUNNING": ("building", "Ray runs the job: its workers start, build and shard the "
                            "model, then run the first step",
                "workers start, build the model, run the first step"),
}
_TICK, _END = object(), object()


def _loss(value) -> str:
    return "non-finite" if value is None or not math.isfinite(value) else f"{value:.4f}"


def _mean(values) -> float | None:
    """The mean; None (shown non-finite) when any value is (stored as null)."""
    values = list(values)
    if any(v is None or not math.isfinite(v) for v in values):
        return None
    return math.fsum(values) / len(values)


class Follower:
    """What ``--follow`` shows for each event. ``interactive``: tqdm bars on
    ``progress`` (a terminal); otherwise a log line per tenth of the steps instead."""

    def __init__(self, job_id: str, total_steps: int, *, progress=None, interactive=None,
                 clock=time.monotonic):
        self.job_id, self.total, self.clock = job_id, total_steps, clock
        self.progress = progress if progress is not None else sys.stderr
        if interactive is None:
            interactive = bool(getattr(self.progress, "isatty", lambda: False)())
        self.interactive = interactive
        self.started, self.status, self.phase = clock(), None, None
        self.last_status: dict = {}  # the last status event (a FAILED one may say why)
        self.first: tuple[int, float] | None = None  # (step, time) of the first record
        self.step, self.logged_step = 0, 0
        self.pending: dict[int, dict] = {}  # step -> {rank: loss} until every rank's came
        self.waiting = self.bar = None

    def elapsed(self) -> float:
        return self.clock() - self.started

    def on_status(self, event: dict) -> None:
        status = self.status = event["status"]
        self.last_status = event
        if self.first is None and status in PHASES:
            self._enter(*PHASES[status])

    def _enter(self, phase: str, what: str, short: str) -> None:
        if phase == self.phase:
            return
        self.phase = phase
        log.info("%s (%.0f s): %s", phase, self.elapsed(), what)
        if not self.interactive:
            return
        if self.waiting is None:
            self.waiting = tqdm(total=None, file=self.progress, leave=False,
                                bar_format="[{elapsed}] {desc}", dynamic_ncols=True)
        else:
            self.waiting.reset()  # each phase counts its own seconds
        self.waiting.set_description_str(f"{phase}: {short} ...")

    def on_record(self, record: dict) -> None:
        """A metrics event. A step moves the bar once every rank's record of it has come
        (the layout in the record says how many), with the loss averaged over the ranks,
        as the dashboard and TensorBoard show it; records without a layout (older
        services) move it on rank 0's loss."""
        step = record.get("step", 0)
        if step <= self.step:
            return
        layout = record.get("layout")
        if not layout:
            if record.get("rank") == 0:
                self._show(step, record.get("loss"))
            return
        losses = self.pending.setdefault(step, {})
        losses[record.get("rank")] = record.get("loss")
        if len(losses) >= layout[0] * layout[1]:
            self.pending = {s: v for s, v in self.pending.items() if s > step}
            self._show(step, _mean(losses.values()))

    def _show(self, step: int, loss) -> None:
        now = self.clock()
        if self.first is None:
            self._first_step(step, now, loss)
        self.step = step
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(f"loss {_loss(loss)}")
        elif self._milestone(step):
            self.logged_step = step
            log.info("step %d/%d  loss %s  ETA %s", step, self.total, _loss(loss),
                     self.eta(now))

    def _milestone(self, step: int) -> bool:
        """The last step, or the first to reach another multiple of a tenth of the steps."""
        every = max(1, self.total // 10)
        return step >= self.total or step // every > self.logged_step // every

    def _first_step(self, step: int, now: float, loss) -> None:
        self.first, self.logged_step = (step, now), step
        self.phase = "training"
        log.info("first step (%.0f s): step %d, loss %s", now - self.started, step,
                 _loss(loss))
        if self.waiting is not None:
            self.waiting.close()
            self.waiting = None
        if self.interactive:
            self.bar = tqdm(total=self.total, initial=step, unit="step", desc="training",
                            file=self.progress, dynamic_ncols=True)

    def eta(self, now: float) -> str:
        """The pace since the first step times the steps left; ``?`` before a pace."""
        step0, t0 = self.first
        if self.step <= step0:
            return "?"
        pace = (now - t0) / (self.step - step0)
        return f"{pace * max(0, self.total - self.step):.0f} s"

    def tick(self) -> None:
        if self.waiting is not None:
            self.waiting.refresh()

    def close(self) -> None:
        for bar in (self.waiting, self.bar):
            if bar is not None:
                bar.close()
        self.waiting = self.bar = None


def final_line(job_id: str, status: str, job: dict | None = None) -> str:
    """``<job>: <status>``; for a failed job whose service gives the reason,
    ``<job>: FAILED: <type>: <message> (rank R, step S)``."""
    failed = failure_line(job) if job else None
    return f"{job_id}: {failed or status}"


def _pumped(events, tick_s: float):
    """``events`` read on a thread; here, each event, or ``_TICK`` when none came for
    ``tick_s`` (to count a phase's seconds). The reader's error is raised here."""
    box: queue.Queue = queue.Queue()

    def read():
        try:
            for item in events:
                box.put(item)
            box.put(_END)
        except BaseException as e:  # noqa: B036 - handed to the main thread
            box.put(e)

    threading.Thread(target=read, daemon=True, name="dmuon-events").start()
    while True:
        try:
            item = box.get(timeout=tick_s)
        except queue.Empty:
            yield _TICK
            continue
        if item is _END:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


def run_follower(follower: Follower, events, tick_s: float = 1.0) -> str:
    """Feeds ``(event, data, id)`` items to ``follower``; the last status seen."""
    try:
        with logging_redirect_tqdm(loggers=[log]):
            for item in _pumped(events, tick_s):
                if item is _TICK:
                    follower.tick()
                elif item[0] == "status":
                    follower.on_status(item[1])
                elif item[0] == "metrics":
                    follower.on_record(item[1])
    finally:
        follower.close()
    return follower.status or "PENDING"


def follow(job_id: str, total_steps: int, out=None, progress=None) -> str:
    """Follow a job to its end; print ``<job>: <status>`` on ``out`` (stdout) and
    return the final status. A failed job's reason, when the service has one, is in
    that line."""
    out = out if out is not None else sys.stdout
    follower = Follower(job_id, total_steps, progress=progress)
    status = run_follower(follower, job_events(job_id))
    job = follower.last_status  # newer services send a FAILED job's reason with it
    if status == "FAILED" and "reason" not in job:
        try:
            job = request("GET", f"/v1/jobs/{job_id}")
        except ServiceError as e:
            log.warning("cannot read why %s failed: %s", job_id, e)
    out.write(final_line(job_id, status, job) + "\n")
    out.flush()
    if status == "FAILED" and not failure_line(job or {}):
        log.info("the job's output: dmuon-svc logs %s", job_id)
    return status
