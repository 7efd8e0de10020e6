"""How a layout is chosen and what it splits: R x N x T (replicate x shard x tp) from a
cluster inventory and the spec, the check that a stored layout still fits the cluster, the
micro-batches per step, and the rows FSDP2 gives each shard.

Torch-free: the control plane and the workers both use it."""

from __future__ import annotations

import math

from ..spec import JobSpec
from .document import Layout
from .inventory import NodeInfo

MAX_WORKERS = 16384  # per job: far past any cluster we plan for, and a plan stays quick


class PlacementError(ValueError):
    """A layout that cannot run on this cluster; the message says why and ``field`` names
    the spec field it refuses (``layout.tp``), as a 422 names it (``spec.layout.tp``)."""

    def __init__(self, message: str, field: str = "layout"):
        super().__init__(message)
        self.field = field


def _mesh_field(spec: JobSpec, tp: int) -> str:
    """The field an uneven R x N x T questions: T when the spec gives one, else the
    shard or replicate size it gives."""
    lay = spec.layout
    return ("layout.tp" if tp > 1 else "layout.shard" if lay.shard is not None
            else "layout.replicate")


def slots(node: NodeInfo, spec: JobSpec) -> int:
    """How many workers of ``spec.resources_per_worker`` fit on ``node`` (at most 1024)."""
    req = spec.resources_per_worker
    fits = [node.cpus // req.CPU if req.CPU else math.inf,
            node.gpus // req.GPU if req.GPU else math.inf]
    fits += [node.resources.get(k, 0) // v for k, v in req.custom.items() if v]
    n = min(fits)
    return 0 if n == math.inf else int(min(n, 1024))


def _factorised(spec: JobSpec, n_nodes: int, per_node: int, tp: int) -> tuple[int, int]:
    """(R, N) as the spec factorises the workers into R x N x T (replicate across nodes
    by default, the T ranks of a tensor-parallel group inside one node)."""
    lay, total = spec.layout, n_nodes * per_node
    if per_node % tp:
        raise PlacementError(
            f"layout.tp={tp} must divide the {per_node} workers per node: a tensor-parallel "
            "group never spans nodes (its activation collectives run over the node's "
            "NVLink)", "layout.tp")
    if lay.replicate is None and lay.shard is None:
        return n_nodes, per_node // tp
    groups = total // tp
    R = lay.replicate or groups // lay.shard
    N = lay.shard or groups // lay.replicate
    if R * N * tp != total:
        mesh = f"{R} x {N}" + (f" x {tp}" if tp > 1 else "")
        raise PlacementError(
            f"{mesh} = {R * N * tp} workers cannot be split evenly over {n_nodes} nodes of "
            f"{per_node} workers ({total} in all)", _mesh_field(spec, tp))
    row = N * tp
    if per_node % row and row % per_node:
        raise PlacementError(
            f"shard size N={N}" + (f" x tp={tp}" if tp > 1 else "") + f" must divide or be "
            f"a multiple of {per_node} workers per node, so that shard groups do not "
            "straddle nodes unevenly", _mesh_field(spec, tp))
    return R, N


def spec_tp(spec: JobSpec) -> int | None:
    """T as the spec gives it; None for ``tp: auto`` (the planner chooses)."""
    return None if spec.layout.tp == "auto" else spec.layout.tp


def nodes_and_workers(nodes: list[NodeInfo], spec: JobSpec) -> tuple[int, int]:
    """(nodes used, workers per node) on this inventory; refuses, with the reason, a
    spec the nodes cannot hold."""
    lay = spec.layout
    usable = [n for n in nodes if slots(n, spec) > 0]
    if not usable:
        raise PlacementError(f"no node fits one worker needing {spec.resources_per_worker}",
                             "resources_per_worker")
    n_nodes = len(usable) if lay.nodes == "auto" else lay.nodes
    if n_nodes > len(usable):
        raise PlacementError(f"layout.nodes={n_nodes} but only {len(usable)} nodes fit a "
                             "worker", "layout.nodes")
    per_node = min(slots(n, spec) for n in usable[:n_nodes])
    if lay.workers_per_node != "auto":
        if lay.workers_per_node > per_node:
            raise PlacementError(
                f"layout.workers_per_node={lay.workers_per_node} but a node fits only "
                f"{per_node} workers of {spec.resources_per_worker.model_dump()}",
                "layout.workers_per_node")
        per_node = lay.workers_per_node
    total = n_nodes * per_node
    if total > MAX_WORKERS:
        raise PlacementError(f"{n_nodes} nodes x {per_node} workers = {total} workers; a job "
                             f"may have at most {MAX_WORKERS}")
    cluster_cpus = sum(n.cpus for n in nodes)
    if total * spec.resources_per_worker.CPU > cluster_cpus:
        raise PlacementError(f"{total} workers need more than the cluster's {cluster_cpus:g} CPUs")
    return n_nodes, per_node


def choose_layout(nodes: list[NodeInfo], spec: JobSpec,
                  tp: int | None = None) -> tuple[int, int, int, int]:
    """(nodes used, R, N, T): T is ``tp``, else the spec's (1 for ``tp: auto``, whose
    choice is the planner's). Refuses uneven or impossible layouts with the reason."""
    n_nodes, per_node = nodes_and_workers(nodes, spec)
    T = tp or spec_tp(spec) or 1
    return (n_nodes, *_factorised(spec, n_nodes, per_node, T), T)


def check_fits(layout: Layout, spec: JobSpec, nodes: list[NodeInfo]) -> None:
    """Refuse, with the reason, a stored layout that the cluster cannot hold now: its
    ``nodes`` nodes must each fit ``replicate * shard * tp / nodes`` workers of the spec."""
    world, wanted = layout.world_size, layout.nodes
    per_node = -(-world // wanted)
    fitting = [n for n in nodes if slots(n, spec) >= per_node]
    if len(fitting) < wanted:
        raise PlacementError(
            f"the stored plan ({layout.shown()} on {wanted} "
            f"node(s), {per_node} workers of {spec.resources_per_worker.model_dump()} each) "
            f"no longer fits: {len(fitting)} of the cluster's {len(nodes)} alive node(s) "
            f"can hold {per_node} workers")


def batch_split(spec: JobSpec, dp_size: int) -> tuple[int, int]:
    """(micro-batches per optimizer step, rows per rank per micro-batch) that make the
    spec's global batch on ``dp_size`` data-parallel ranks: ``batch_size`` rows per
    micro-batch, accumulated to ``global_batch_tokens``. An elastic job keeps its global
    batch on every layout, so where ``batch_size`` does not divide a rank's share it
    takes fewer rows per micro-batch and more micro-batches. Refuses (naming the field)
    a global batch that cannot be split so."""
    if spec.global_batch_tokens is None:
        return 1, spec.batch_size
    per_micro = spec.batch_size * spec.seq_len * dp_size
    if spec.global_batch_tokens % per_micro == 0:
        return spec.global_batch_tokens // per_micro, spec.batch_size
    rows = spec.global_batch_tokens // spec.seq_len
    if spec.layout.elastic is None or spec.global_batch_tokens % spec.seq_len:
        raise ValueError(f"global_batch_tokens: {spec.global_batch_tokens} is not a multiple "
                         f"of batch_size x seq_len x {dp_size} data-parallel ranks = "
                         f"{per_micro}")
    if rows % dp_size:
        raise ValueError(f"global_batch_tokens: {rows} sequences per step cannot be split "
                         f"evenly over {dp_size} data-parallel ranks")
    share = rows // dp_size
    per_rank = max(d for d in range(1, min(share, spec.batch_size) + 1) if share % d == 0)
    return share // per_rank, per_rank


def fsdp2_rows(rows: int, shards: int, shard: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of dim 0 that FSDP2 gives shard ``shard`` of ``shards``: chunks of
    ceil(rows / shards), as ``torch.chunk`` cuts them, the last ones short or empty."""
    per = -(-rows // shards)
    return min(rows, shard * per), min(rows, (shard + 1) * per)
