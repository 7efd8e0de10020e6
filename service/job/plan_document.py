"""The plan document: what the planner decided for a job, stored once and run as stored.

Typed so that every reader (the API, the driver, the workers, the CLI) reads the same
fields; the partition inside it is ``dmuon.DedicationPlan.to_dict()``, which the workers
hand to ``dmuon.dedicate_params(plan=...)`` rather than partitioning again. It is the
job's data, beside ``job.py``: the workers read it and import nothing of the planner
(``service.job.plan``). The layout is ``service.job.layout.Layout``; a document stored
before it carried hosts and the batch split loads as it was (``stored_layout``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    computed_field,
    field_validator,
    model_serializer,
    model_validator,
)

from .layout import Layout

# The kinds of a rank's memory, in ``dmuon.memory_report``'s order (``dmuon.MEMORY_KINDS``;
# tests/job/test_planner.py checks they agree): named here so the control plane, which
# shows them, needs no dmuon
MEMORY_KINDS = ("packed_buffers", "owned_params", "momentum", "fsdp_shards", "adamw_state")


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


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


class OptimizerSplit(_Doc):
    """Which params Muon steps and which AdamW does, the hook boundaries and why."""
    muon: list[str]
    adamw: list[str]
    hook_boundaries: list[str]
    adamw_why: dict[str, str]
    # per param: its route (muon, adamw on an owner, sharded_adamw: FSDP2's) and, with
    # dmuon.param_policy, that policy's fields (service.job.models.routing); none in a
    # plan stored before routes
    routes: dict[str, dict] | None = None


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


def stored_layout(value):
    """A layout as stored: a ``Layout``, or its JSON form (a document stored before the
    layout carried ``workers_per_node`` and the batch split loads, those derived or
    left to the driver); an unknown key is refused, as every other field's is."""
    if isinstance(value, Layout) or not isinstance(value, dict):
        return value
    unknown = set(value) - {f.name for f in dataclasses.fields(Layout)}
    if unknown:
        raise ValueError(f"layout: unknown field(s) {sorted(unknown)}")
    return Layout(**value)


class ElasticLayout(_Doc):
    """One node count of an elastic range: the layout it runs (with how its ranks split
    the global batch), and the predictions and partition made for it; or why it cannot
    run (its layout then carries no batch split where that is the reason)."""

    layout: Layout
    modes: Modes | None = None
    ranks: list[RankPrediction] = []
    partition: dict | None = None
    refused: str | None = None

    _layout = field_validator("layout", mode="before")(stored_layout)

    @model_validator(mode="before")
    @classmethod
    def _split_into_layout(cls, data):
        """The batch split was stored beside the layout (and is still shown there, for
        the API's readers): it is the layout's now."""
        if isinstance(data, dict) and ("micro_batches" in data or "rows_per_micro" in data):
            data = dict(data)
            split = {k: data.pop(k) for k in ("micro_batches", "rows_per_micro") if k in data}
            layout = data.get("layout")
            if isinstance(layout, dict) and split.get("micro_batches") is not None:
                data["layout"] = {**layout, **split}
        return data

    @computed_field
    @property
    def micro_batches(self) -> int | None:
        return self.layout.micro_batches

    @computed_field
    @property
    def rows_per_micro(self) -> int | None:
        return self.layout.rows_per_micro


class PlanDocument(_Doc):
    layout: Layout
    inventory: Inventory
    scaling: Scaling
    modes: Modes | None = None
    # stored as ``param_groups`` before 2026-12-05: such documents still load
    optimizer_split: OptimizerSplit | None = Field(
        None, validation_alias=AliasChoices("optimizer_split", "param_groups"))
    ranks: list[RankPrediction] = []
    partition: dict | None = None  # dmuon.DedicationPlan.to_dict()
    # a model only the job's own processes can import: the entrypoint plans it, once
    deferred: str | None = None
    # who completed a deferred plan: the driver ("entrypoint" in documents before
    # 2026-12-05, read as "driver")
    completed_by: Literal["driver"] | None = None
    # an elastic job: every node count of its range, smallest first; the fields above
    # are the largest runnable one's, the layout Ray Train asks for first
    elastic: list[ElasticLayout] | None = None
    # a pipeline-parallel layout (pp > 1): the stage split and per pp rank its ranks,
    # stages, NS load, memory and pp bytes (service.job.plan.pipeline_plan); the workers
    # run its stage split (service.worker.pipeline_run), each stage's partition made
    # there, deterministically, from the stage and its mesh
    pipeline: dict | None = None

    _layout = field_validator("layout", mode="before")(stored_layout)

    @field_validator("completed_by", mode="before")
    @classmethod
    def _driver(cls, value):
        return "driver" if value == "entrypoint" else value

    @property
    def complete(self) -> bool:
        """Ready to run: a partition, or a pipeline's stage split (each stage's
        partition is made by its workers)."""
        return self.partition is not None or self.pipeline is not None

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
