"""The plan document: what the planner decided for a job, stored once and run as stored.

Typed so that every reader (the API, the entrypoint, the workers, the CLI) reads the same
fields; the partition inside it is ``dmuon.DedicationPlan.to_dict()``, which the workers
hand to ``dmuon.dedicate_params(plan=...)`` rather than partitioning again.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

# The kinds of a rank's memory, in ``dmuon.memory_report``'s order (``dmuon.MEMORY_KINDS``;
# tests/test_planner.py checks they agree): named here so the control plane, which
# shows them, needs no dmuon
MEMORY_KINDS = ("packed_buffers", "owned_params", "momentum", "fsdp_shards", "adamw_state")


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Layout(_Doc):
    """R x N x T (replicate x shard x tp) on ``nodes`` nodes; T = 1 (a document stored
    before tensor parallelism has no ``tp``) is the R x N mesh."""

    replicate: int
    shard: int
    nodes: int
    tp: int = 1
    ep: int = 1  # the EP group: ep consecutive shard ranks (no mesh dim of its own)

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tp

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: the T ranks of a tensor-parallel group share one."""
        return self.replicate * self.shard

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """(R, N), or (R, N, T) under tensor parallelism: the workers' mesh and records."""
        return (self.replicate, self.shard) + ((self.tp,) if self.tp > 1 else ())

    def shown(self) -> str:
        """``2 x 4``, ``2 x 2 x 2``, ``1 x 4, ep 2``: the mesh as the CLI and the
        dashboard print it, with the EP degree where experts are split."""
        mesh = " x ".join(map(str, self.mesh_shape))
        return f"{mesh}, ep {self.ep}" if self.ep > 1 else mesh


class Inventory(_Doc):
    """The nodes planned on: the attached cluster's, or assumed ones (with the reason)."""

    source: Literal["cluster", "assumed"]
    nodes: int
    cpus_per_node: int | None = None
    gpus_per_node: int | None = None  # given nodes (``dmuon-svc plan --nodes``)
    reason: str | None = None

    @model_serializer(mode="wrap")
    def _without_unset(self, handler):  # a cluster's inventory is its source and size
        return {k: v for k, v in handler(self).items() if v is not None}


class Modes(_Doc):
    """``service.job.plan.modes.ModeChoice``: the mode run and why."""

    dmuon: Literal["z2", "z3"]
    fsdp: Literal["z2", "z3"]
    reason: str
    params: int
    gpus: int
    device_bytes: int
    z2_bytes: int
    z3_bytes: int
    resident_pm_bytes: int
    fits: bool


class ParamGroups(_Doc):
    muon: list[str]
    adamw: list[str]
    hook_boundaries: list[str]
    adamw_why: dict[str, str]


class RankPrediction(_Doc):
    rank: int
    coord: tuple[int, ...] = Field(min_length=2, max_length=3)  # (r, s), (r, s, t) if T > 1
    owned_elements: int
    ns_flops: int
    memory: dict[str, int]  # dmuon.MEMORY_KINDS at rest after a step
    packed_peak: int  # packed-buffer bytes at the worst hook
    ledger: dict[str, dict[str, int | float]]  # {mesh dim: {phase: bytes per step}}
    comm_seconds: float


class Scaling(_Doc):
    """``ray.train.ScalingConfig``'s arguments (``min_workers``: an elastic range)."""

    num_workers: int
    use_gpu: bool
    resources_per_worker: dict[str, float]
    placement_strategy: str
    min_workers: int | None = None
    elastic_resize_monitor_interval_s: float | None = None

    def config_kwargs(self) -> dict:
        kwargs = self.model_dump(exclude_none=True, exclude={"min_workers"})
        if self.min_workers is not None:
            kwargs["num_workers"] = (self.min_workers, self.num_workers)
        return kwargs


class ElasticLayout(_Doc):
    """One node count of an elastic range: the layout it runs, how its ranks split the
    global batch, and the predictions and partition made for it; or why it cannot run."""

    layout: Layout
    micro_batches: int | None = None
    rows_per_micro: int | None = None
    modes: Modes | None = None
    ranks: list[RankPrediction] = []
    partition: dict | None = None
    refused: str | None = None


class PlanDocument(_Doc):
    layout: Layout
    inventory: Inventory
    scaling: Scaling
    modes: Modes | None = None
    param_groups: ParamGroups | None = None
    ranks: list[RankPrediction] = []
    partition: dict | None = None  # dmuon.DedicationPlan.to_dict()
    # a model only the job's own processes can import: the entrypoint plans it, once
    deferred: str | None = None
    completed_by: Literal["entrypoint"] | None = None
    # an elastic job: every node count of its range, smallest first; the fields above
    # are the largest runnable one's, the layout Ray Train asks for first
    elastic: list[ElasticLayout] | None = None

    @property
    def complete(self) -> bool:
        return self.partition is not None

    def runnable(self) -> list[ElasticLayout]:
        return [e for e in self.elastic or [] if e.refused is None]

    def for_world(self, world_size: int) -> PlanDocument:
        """The plan of the layout an elastic job runs on ``world_size`` workers (a
        fixed job's own, when that is its size); ValueError naming the sizes it has."""
        if self.elastic is None and world_size == self.layout.world_size:
            return self
        entry = next((e for e in self.runnable() if e.layout.world_size == world_size), None)
        if entry is None:
            sizes = [e.layout.world_size for e in self.runnable()] or [self.layout.world_size]
            raise ValueError(f"Ray Train started {world_size} workers; the plan has layouts "
                             f"for {', '.join(map(str, sizes))} workers")
        return self.model_copy(update={
            "layout": entry.layout, "modes": entry.modes, "ranks": entry.ranks,
            "partition": entry.partition})


def partition_digest(partition: dict) -> str:
    """A short fingerprint of who owns what (units, shapes, boundaries, owners) on which
    mesh: the workers report the one they run, which equals the stored plan's."""
    units = {u: [a["owner"], list(a["shape"]), a["boundary"]]
             for u, a in partition["params"].items()}
    ep = [partition["ep_size"]] if partition.get("ep_size", 1) > 1 else []
    text = json.dumps([partition["replicate_size"], partition["shard_size"], units, *ep],
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
