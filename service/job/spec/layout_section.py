"""Where a job runs: the R x N layout (or an elastic node range) and what each worker
reserves on its node. Torch-free, like every spec section."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from .field_types import Count, StrictModel, text

_Strict = StrictModel


class ElasticSpec(_Strict):
    """A node range instead of a node count: the job starts on as many nodes of the range
    as the cluster holds, goes on with fewer when a node is lost (from its last committed
    checkpoint, on the planner's layout for what remains) and grows back when capacity
    returns. Each node count runs ``nodes`` x ``workers_per_node`` / T x T (replicate x
    shard x tp): ``layout.tp`` stays the same on every count."""

    min_nodes: int = Field(1, ge=1, le=1024)
    max_nodes: int = Field(ge=1, le=1024)
    resize_check_s: float = Field(
        60.0, ge=0, le=86400, description="while healthy, how often Ray Train looks for "
        "returned capacity (ScalingConfig.elastic_resize_monitor_interval_s)")
    start_timeout_s: float = Field(
        60.0, gt=0, le=86400, description="how long a worker group waits for the workers "
        "it asked for before it asks for what the cluster holds; right after a node dies "
        "Ray Train may still count it (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S)")
    max_wait_s: float | None = Field(
        None, gt=0, le=30 * 86400, description="how long the job may wait, at its start or "
        "after a loss, while the cluster holds fewer workers than the range's smallest "
        "runnable layout needs; then it fails naming both counts. null: it waits as long "
        "as Ray Train does, which is for ever")

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes={self.min_nodes} exceeds max_nodes={self.max_nodes}")
        return self


class LayoutSpec(_Strict):
    """The R x N mesh: replicate across nodes, shard within a node, unless given; with
    ``tp`` > 1 the R x N x T mesh, T tensor-parallel ranks inside each node."""

    nodes: Count = "auto"
    workers_per_node: Count = "auto"
    replicate: int | None = Field(None, ge=1, le=1024, description="R, overriding nodes")
    shard: int | None = Field(None, ge=1, le=1024,
                              description="N, overriding workers_per_node")
    tp: Count = Field(1, description="T, the tensor-parallel degree: each group of T "
                      "workers of one node splits every block's matrices (colwise q/k/v "
                      "and gate/up, rowwise o/down, sequence parallel on the norms) and "
                      "shares one data-parallel rank; R x N x T = the workers. T must "
                      "divide the workers of a node (groups never span hosts) and the "
                      "model's heads, KV heads and FFN width. auto: the planner takes the "
                      "smallest such T with which a rank fits its memory and the global "
                      "batch splits")
    ep: Count = Field(1, description="P, the expert-parallel degree: each MoE layer's "
                      "experts are split over P consecutive shard ranks (the EP group, "
                      "inside one node where the shard group is), each holding E/P of "
                      "them, tokens sent to their experts all-to-all; the ranks of one EP "
                      "coordinate own its experts DMuon's way. P must divide the shard "
                      "size N and every MoE layer's experts. auto: the largest such P, "
                      "1 for a dense model")
    elastic: ElasticSpec | None = Field(None, description="a node range (see ElasticSpec)")

    @model_validator(mode="after")
    def _elastic_sets_the_nodes(self):
        if self.elastic is not None:
            given = [k for k in ("nodes", "replicate", "shard")
                     if getattr(self, k) not in (None, "auto")]
            if given:
                raise ValueError(f"layout.{given[0]} cannot be set with layout.elastic: "
                                 "R is the nodes running (one replica per node), N is "
                                 "workers_per_node")
        return self


class ResourcesSpec(_Strict):
    CPU: float = Field(1, ge=0, le=1 << 20)
    GPU: float = Field(0, ge=0, le=1 << 10)
    custom: dict[text(64, 1), Annotated[float, Field(ge=0, le=1 << 30)]] = Field(
        default_factory=dict, max_length=16)
