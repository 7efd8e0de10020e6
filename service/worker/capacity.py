"""An elastic job's watch on the cluster between steps. Ray Train's resize check restarts
a healthy worker group on more workers as soon as it sees them, from the last committed
checkpoint, so every step since that checkpoint would run twice. Rank 0 counts, between
steps, the workers Ray Train could start now (its own rule: alive nodes, each node's
resources over a worker's, capped at the range's maximum); when that is a larger layout
the plan runs, every rank checkpoints that very step. Ray's resize then resumes from it
and repeats only the steps taken while its check had not yet come (its view of the
cluster lags the nodes' own by up to its coordinator's 20 s tick).

The count is a collective (a broadcast from rank 0): every rank takes the same
checkpoints. Below the range's smallest layout Ray Train waits for ever: ``deadline.py``
bounds that."""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
HEAD_ONLY = "node:__internal_head__"  # a head node without CPUs or GPUs takes no worker


def workers_on(nodes: list[dict], per_worker: dict[str, float], max_workers: int) -> int:
    """How many workers of ``per_worker`` resources the alive ``nodes`` (``ray.nodes()``)
    hold, at most ``max_workers``: Ray Train's elastic count
    (``ElasticScalingPolicy._count_possible_workers``, ray 2.60)."""
    total = 0
    for node in nodes:
        res = node["Resources"]
        if not node["Alive"] or (HEAD_ONLY in res and not res.get("CPU") and not res.get("GPU")):
            continue
        total += min(int(res.get(k, 0.0) // v) for k, v in per_worker.items() if v > 0)
    return min(total, max_workers)


def worker_resources(scaling) -> dict[str, float]:
    """A worker's resources as Ray Train asks for them, from the plan's ``scaling``: zero
    entries dropped, a GPU each when ``use_gpu``
    (``ScalingConfig._resources_per_worker_not_none``, ray 2.60)."""
    per_worker = {k: v for k, v in scaling.resources_per_worker.items() if v}
    if scaling.use_gpu:
        per_worker.setdefault("GPU", 1)
    return per_worker


def ray_capacity(scaling, max_workers: int) -> Callable[[], int | None]:
    """The count for this Ray cluster (None when the GCS does not answer this time)."""
    import ray

    per_worker = worker_resources(scaling)

    def count() -> int | None:
        try:
            return workers_on(ray.nodes(), per_worker, max_workers)
        except Exception as e:  # a GCS hiccup only delays a grow: the next step asks again
            log.warning("could not count the cluster's workers: %s", e)
            return None
    return count


class CapacityWatch:
    """Per step: (the workers Ray Train could start now, whether to checkpoint this
    step); rank 0 asks ``count`` at most every ``every_s`` seconds. One checkpoint a
    rise: a count that stays up, or comes back after dipping above the running size,
    checkpoints once."""

    def __init__(self, count: Callable[[], int | None], runnable: set[int], world: int,
                 device: torch.device, every_s: float = 1.0):
        self.count, self.runnable, self.world, self.device = count, runnable, world, device
        self.every_s, self.asked_at, self.last = every_s, float("-inf"), world
        self.acted_on: int | None = None

    def _ask(self) -> int:
        if time.monotonic() - self.asked_at >= self.every_s:
            self.asked_at = time.monotonic()
            counted = self.count()
            self.last = self.last if counted is None else counted
        return self.last

    def poll(self) -> tuple[int, bool]:
        n = torch.tensor([self._ask() if dist.get_rank() == 0 else 0], device=self.device)
        dist.broadcast(n, 0)
        workers = int(n.item())
        if workers <= self.world:
            self.acted_on = None
            return workers, False
        grow = workers in self.runnable and workers != self.acted_on
        self.acted_on = workers if grow else self.acted_on
        return workers, grow
