"""The layout a job runs: torchtitan's ``ParallelDims`` in this project's words. One
frozen value carries every degree (replicate, shard, tp, ep, and pp, kept for pipeline
parallelism), the hosts and workers per host, and how a step splits the global batch
(micro-batches, rows per micro-batch). The planner chooses it
(``service.job.plan.layout_choice.choose_layout``), the plan document stores it, the
driver hands it to the workers inside that document, each worker builds its mesh from it
(``service.worker.mesh.build_mesh``) and reports the one it ran as this same type. It is
checked once, here, with errors naming the spec field a bad value comes from, so no
reader re-derives sizes from a mesh or a tuple.

Torch-free, a plain dataclass: the plan document (pydantic) stores it as a field."""

from __future__ import annotations

import dataclasses

from .spec import SpecError


class PlacementError(SpecError):
    """A layout that cannot run (on this cluster); the message says why and ``field``
    names the spec field it refuses (``layout.tp``), as a 422 names it
    (``spec.layout.tp``). A SpecError: whatever refuses a spec refuses it too."""

    def __init__(self, message: str, field: str = "layout"):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class Layout:
    """R x N x T (replicate x shard x tp) workers on ``nodes`` hosts of
    ``workers_per_node``; the EP group is ``ep`` consecutive shard ranks (no mesh dim of
    its own). ``micro_batches`` x ``rows_per_micro`` rows per data-parallel rank make
    one step's global batch (None: not split yet, as in a document stored before the
    layout carried it; the driver completes it before any worker starts)."""

    replicate: int
    shard: int
    nodes: int
    tp: int = 1
    ep: int = 1
    pp: int = 1  # pipeline stages, outermost: pp x replicate x shard x tp
    workers_per_node: int | None = None  # None: the world over the hosts (old documents)
    micro_batches: int | None = None
    rows_per_micro: int | None = None
    pp_schedule: str = "1f1b"  # 1f1b, interleaved or gpipe (the spec's layout.pp_schedule)
    pp_stages_per_rank: int = 1  # v: the interleaved schedule's stages on each pp rank

    def __post_init__(self):
        for name in ("replicate", "shard", "nodes", "tp", "ep", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlacementError(f"layout.{name}={value!r} must be a positive integer",
                                     f"layout.{name}")
        if self.workers_per_node is None:  # a stored document's hosts share the world
            object.__setattr__(self, "workers_per_node", -(-self.world_size // self.nodes))
        self._check_degrees()
        self._check_hosts()
        if (self.micro_batches is None) != (self.rows_per_micro is None) or any(
                v is not None and v < 1 for v in (self.micro_batches, self.rows_per_micro)):
            raise PlacementError(f"a batch split of {self.micro_batches} micro-batches of "
                                 f"{self.rows_per_micro} rows", "global_batch_tokens")
        if self.pp_enabled and self.micro_batches is not None \
                and self.micro_batches < self.pp:
            raise PlacementError(
                f"global_batch_tokens: {self.micro_batches} micro-batches per step, fewer "
                f"than layout.pp={self.pp} stages: every stage needs a micro-batch in flight "
                "(raise global_batch_tokens or lower batch_size)", "global_batch_tokens")

    def _check_degrees(self) -> None:
        if (self.pp_stages_per_rank > 1) != (self.pp_schedule == "interleaved"):
            raise PlacementError(f"layout.pp_stages_per_rank={self.pp_stages_per_rank} with "
                                 f"pp_schedule {self.pp_schedule}", "layout.pp_stages_per_rank")
        if self.shard % self.ep:
            raise PlacementError(f"layout.ep = {self.ep} does not divide the shard size "
                                 f"N = {self.shard}: the EP group is P consecutive shard "
                                 "ranks", "layout.ep")

    def _check_hosts(self) -> None:
        per_node, world = self.workers_per_node, self.world_size
        if per_node % self.tp:
            raise PlacementError(
                f"layout.tp={self.tp} must divide the {per_node} workers per node: a "
                "tensor-parallel group never spans nodes (its activation collectives run "
                "over the node's NVLink)", "layout.tp")
        if per_node * self.nodes != world:
            raise PlacementError(f"{self.shown()} = {world} workers cannot be split evenly "
                                 f"over {self.nodes} nodes of {per_node} workers",
                                 "layout.shard" if self.tp == 1 else "layout.tp")
        row = self.shard * self.tp
        if per_node % row and row % per_node:
            raise PlacementError(
                f"shard size N={self.shard}" + (f" x tp={self.tp}" if self.tp > 1 else "")
                + f" must divide or be a multiple of {per_node} workers per node, so that "
                "shard groups do not straddle nodes unevenly",
                "layout.tp" if self.tp > 1 else "layout.shard")

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: the T ranks of a tensor-parallel group share one."""
        return self.replicate * self.shard

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def batch(self) -> tuple[int, int]:
        """(micro-batches, rows per rank per micro-batch); the layout must carry them."""
        if self.micro_batches is None:
            raise ValueError("the layout carries no batch split (a plan not completed)")
        return self.micro_batches, self.rows_per_micro

    @property
    def stage_ranks(self) -> int:
        """The ranks holding one pipeline stage: R x N x T (the world without pp)."""
        return self.replicate * self.shard * self.tp

    def stage_of(self, rank: int) -> int:
        """The pp coordinate of ``rank``: pp is the outermost mesh dim."""
        return rank // self.stage_ranks

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The workers' mesh dims: ("replicate", "shard"), with "tp" under TP and "pp"
        outermost under PP (torchtitan's order: pp, replicate, shard, tp)."""
        return (("pp",) if self.pp_enabled else ()) + ("replicate", "shard") + (
            ("tp",) if self.tp_enabled else ())

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """(R, N), (R, N, T) under tensor parallelism, (pp, R, N[, T]) under pipeline
        parallelism: the workers' mesh and records."""
        return (((self.pp,) if self.pp_enabled else ()) + (self.replicate, self.shard)
                + ((self.tp,) if self.tp_enabled else ()))

    def shown(self) -> str:
        """``2 x 4``, ``2 x 2 x 2``, ``1 x 4, ep 2``, ``pp 4 x 1 x 8 x 8``: the mesh as
        the CLI and the dashboard print it, with the EP degree where experts are split."""
        mesh = ("pp " if self.pp_enabled else "") + " x ".join(map(str, self.mesh_shape))
        return f"{mesh}, ep {self.ep}" if self.ep_enabled else mesh

    def replace(self, **changes) -> Layout:
        """A copy with ``changes``, checked as a new one is."""
        return dataclasses.replace(self, **changes)


def fsdp2_rows(rows: int, shards: int, shard: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of dim 0 that FSDP2 gives shard ``shard`` of ``shards``: chunks of
    ceil(rows / shards), as ``torch.chunk`` cuts them, the last ones short or empty."""
    per = -(-rows // shards)
    return min(rows, shard * per), min(rows, (shard + 1) * per)
