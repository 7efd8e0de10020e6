"""An elastic job's bound on waiting for capacity (``layout.elastic.max_wait_s``), on
Ray Train's controller. Below ``min_workers`` Ray Train's scaling policy answers "no"
each control-loop pass and the state stays Initializing / Restarting / Rescheduling
(``ElasticScalingPolicy.make_decision_for_non_running_worker_group``, ray 2.60), for
ever. The controller calls ``after_controller_state_update`` every pass, and an
exception there is a non-retryable ``ControllerError``: the run fails with it, and the
reason written here is the job's. The clock runs while no worker group runs (those
states, and Scheduling: a start that times out on a node Ray still counts goes back to
waiting). A group's start-up takes time and Ray's view of the cluster lags the nodes'
own (its coordinator's 20 s tick), so the deadline is met only when the nodes, counted
by Ray's rule, hold too few workers too; else the clock starts again."""

from __future__ import annotations

import logging
import time

from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.controller.state import (
    InitializingState,
    ReschedulingState,
    RestartingState,
    SchedulingState,
)

from service.job import failure
from service.worker.capacity import worker_resources, workers_on

log = logging.getLogger(__name__)
WAITING = (InitializingState, SchedulingState, ReschedulingState, RestartingState)


class CapacityTimeout(RuntimeError):
    """An elastic job waited ``max_wait_s`` for the workers of its smallest layout."""


class CapacityDeadline(ControllerCallback):
    """Fail the job once it has gone ``max_wait_s`` without a worker group because the
    cluster holds fewer workers than the plan's smallest layout needs."""

    def __init__(self, plan, max_wait_s: float, failure_file: str):
        smallest = plan.runnable()[0].layout
        # the minimum Ray Train itself is given, so the two wait on the same count
        self.needs = plan.scaling.min_workers
        self.smallest = f"{smallest.replicate} x {smallest.shard}"
        self.per_worker, self.max_workers = worker_resources(plan.scaling), plan.scaling.num_workers
        self.max_wait_s, self.failure_file = max_wait_s, failure_file
        self.since: float | None = None

    def after_controller_state_update(self, previous_state, current_state):
        if not isinstance(current_state, WAITING):
            self.since = None
            return
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        if now - self.since >= self.max_wait_s:
            self._fail_unless_capacity(now - self.since)

    def _fail_unless_capacity(self, waited: float) -> None:
        import ray

        holds = workers_on(ray.nodes(), self.per_worker, self.max_workers)
        if holds >= self.needs:  # starting, or Ray's view is behind: another term
            log.warning("no worker group for %.0f s, but the nodes hold %d workers (the "
                        "smallest layout needs %d): waiting on", waited, holds, self.needs)
            self.since = time.monotonic()
            return
        error = CapacityTimeout(
            f"waited {waited:.0f} s for capacity (layout.elastic.max_wait_s = "
            f"{self.max_wait_s:g}): the cluster holds {holds} worker(s) of "
            f"{self.per_worker}; the smallest layout the plan runs, {self.smallest}, "
            f"needs {self.needs}")
        failure.record_first(self.failure_file, failure.describe(
            error, rank=None, step=None, phase=None, source="controller"))
        raise error
