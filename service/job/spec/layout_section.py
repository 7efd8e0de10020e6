"""Where a job runs: the R x N layout (or an elastic node range) and what each worker
reserves on its node. Torch-free, like every spec section."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from .field_types import Count, StrictModel, text

_Strict = StrictModel

# the pipeline schedules the planner costs (torch.distributed.pipelining's 1F1B, its
# interleaved 1F1B and GPipe); zero-bubble ones are refused with why (ZERO_BUBBLE)
PP_SCHEDULES = ("1f1b", "interleaved", "gpipe")
ZERO_BUBBLE = ("zb", "zbv", "zero_bubble", "zerobubble", "interleaved_zb",
               "interleavedzerobubble", "zbvzerobubble", "dualpipev", "dualpipe")


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
    pp: Count = Field(1, description="the pipeline-parallel degree: the model's layers "
                      "split into pp contiguous stages (the embedding on the first, the "
                      "final norm and the head on the last), outermost on the mesh (pp x "
                      "replicate x shard x tp), across hosts; R x N x T ranks hold each "
                      "stage. The planner splits the layers so that the slowest stage's "
                      "forward + backward and Newton-Schulz step is least. At most the "
                      "model's layers (a stage holds at least one); a step needs at least "
                      "pp micro-batches. auto: the smallest pp with which a rank fits. "
                      "pp (x pp_stages_per_rank) must divide the decoder layers, and tp the "
                      "seq_len; not with layout.elastic, nor model.weights with ep > 1")
    pp_schedule: str = Field("1f1b", description="the pipeline schedule: 1f1b, "
                             "interleaved (pp_stages_per_rank stages on each rank) or "
                             "gpipe; zero-bubble schedules are refused (DMuon's stage runs "
                             "full backward passes only)")
    pp_stages_per_rank: int | None = Field(None, ge=1, le=16, description="v, the "
                                           "stages each pipeline rank holds: 1 for 1f1b "
                                           "and gpipe, at least 2 for interleaved (null: "
                                           "2 there, else 1)")
    elastic: ElasticSpec | None = Field(None, description="a node range (see ElasticSpec)")

    @field_validator("pp_schedule")
    @classmethod
    def _known_schedule(cls, v: str) -> str:
        name = v.strip().lower().replace("-", "_")
        if name.replace("_", "") in {z.replace("_", "") for z in ZERO_BUBBLE}:
            raise ValueError(f"{v!r} is a zero-bubble schedule, which splits each backward "
                             "into an input pass and a weight pass; dmuon.PipelineStage runs "
                             "full backward passes only (DMuon reduces a stage's gradients "
                             "with its last full backward): use 1f1b, interleaved or gpipe")
        if name not in PP_SCHEDULES:
            raise ValueError(f"{v!r} is no pipeline schedule: one of {', '.join(PP_SCHEDULES)}")
        return name

    @model_validator(mode="after")
    def _stages_per_rank_interleave(self):
        v = self.pp_stages_per_rank
        if v is not None and (v > 1) != (self.pp_schedule == "interleaved"):
            raise ValueError(f"layout.pp_stages_per_rank={v} with "
                             f"pp_schedule {self.pp_schedule}: interleaved needs at least 2 "
                             "stages per rank, 1f1b and gpipe hold 1")
        if self.pp != 1 and self.elastic is not None:
            raise ValueError("layout.pp cannot be set with layout.elastic: an elastic range "
                             "varies R only")
        return self

    @property
    def stages_per_rank(self) -> int:
        """v: the spec's, else 2 for interleaved and 1 for the others."""
        v = self.pp_stages_per_rank
        return v if v is not None else 2 if self.pp_schedule == "interleaved" else 1

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
