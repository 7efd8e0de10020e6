"""How a layout is chosen and what it splits: the ``Layout`` (R x N x T, replicate x
shard x tp, its hosts and its batch split) from a cluster inventory and the spec, Ray
Train's scaling for it, the check that a stored layout still fits the cluster, the
micro-batches per step, and the rows FSDP2 gives each shard.

Torch-free: the control plane and the driver plan with it; the workers read the layout
it made from the stored plan."""

from __future__ import annotations

import math

from ..layout import Layout, PlacementError, fsdp2_rows
from ..spec import JobSpec
from .inventory import NodeInfo

__all__ = ["Layout", "PlacementError", "batch_split", "check_fits", "choose_layout",
           "fsdp2_rows", "layout_of", "nodes_and_workers", "scaling_kwargs", "slots",
           "spec_pp", "spec_tp"]

MAX_WORKERS = 16384  # per job: far past any cluster we plan for, and a plan stays quick


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


def _factorised(spec: JobSpec, n_nodes: int, per_node: int, tp: int,
                pp: int = 1) -> tuple[int, int]:
    """(R, N) as the spec factorises the workers into pp x R x N x T (replicate across
    nodes by default, the T ranks of a tensor-parallel group inside one node, the pp
    stages outermost: across nodes where they divide them)."""
    lay, total = spec.layout, n_nodes * per_node
    if total % (pp * tp) and per_node % tp == 0:  # else Layout names layout.tp
        raise PlacementError(f"layout.pp={pp} x tp={tp} does not divide the {total} workers",
                             "layout.pp")
    if (lay.replicate is None and lay.shard is None) or per_node % tp:
        # a T that does not divide the node's workers: Layout's check refuses it
        if pp == 1:
            return n_nodes, max(1, per_node // tp)
        R = n_nodes // pp if n_nodes % pp == 0 else 1
        return R, total // (pp * tp * R)
    groups = total // (tp * pp)
    R = lay.replicate or groups // lay.shard
    N = lay.shard or groups // lay.replicate
    if R * N * tp * pp != total:
        mesh = (f"pp {pp} x " if pp > 1 else "") + f"{R} x {N}" + (f" x {tp}" if tp > 1 else "")
        raise PlacementError(
            f"{mesh} = {R * N * tp * pp} workers cannot be split evenly over {n_nodes} nodes of "
            f"{per_node} workers ({total} in all)", _mesh_field(spec, tp))
    return R, N  # how shard groups sit on the nodes: Layout's own check


def spec_tp(spec: JobSpec) -> int | None:
    """T as the spec gives it; None for ``tp: auto`` (the planner chooses)."""
    return None if spec.layout.tp == "auto" else spec.layout.tp


def spec_pp(spec: JobSpec) -> int | None:
    """pp as the spec gives it; None for ``pp: auto`` (the planner chooses)."""
    return None if spec.layout.pp == "auto" else spec.layout.pp


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


def choose_layout(nodes: list[NodeInfo], spec: JobSpec, tp: int | None = None,
                  pp: int | None = None) -> Layout:
    """The layout on these nodes: T is ``tp``, else the spec's (1 for ``tp: auto``, whose
    choice is the planner's); pp likewise; P the spec's (1 for ``ep: auto``, which the
    planner resolves on the model). Refuses uneven or impossible layouts with the reason."""
    n_nodes, per_node = nodes_and_workers(nodes, spec)
    T = tp or spec_tp(spec) or 1
    PP = pp or spec_pp(spec) or 1
    return layout_of(spec, n_nodes, per_node, *_factorised(spec, n_nodes, per_node, T, PP),
                     T, pp=PP)


def layout_of(spec: JobSpec, nodes: int, per_node: int, R: int, N: int, T: int,
              batch: bool = True, pp: int = 1) -> Layout:
    """R x N x T on ``nodes`` hosts of ``per_node`` workers, with the spec's EP degree
    and (``batch``) the spec's global batch split over its R x N data-parallel ranks; a
    batch that does not split is refused naming ``global_batch_tokens``."""
    ep = spec.layout.ep if isinstance(spec.layout.ep, int) else 1
    split = {}
    if batch:
        try:
            micros, rows = batch_split(spec, R * N)
        except ValueError as e:
            raise PlacementError(str(e), "global_batch_tokens") from None
        split = {"micro_batches": micros, "rows_per_micro": rows}
    lay = spec.layout
    return Layout(R, N, nodes, tp=T, ep=ep, pp=pp, workers_per_node=per_node,
                  pp_schedule=lay.pp_schedule, pp_stages_per_rank=lay.stages_per_rank,
                  **split)


def scaling_kwargs(spec: JobSpec, layout: Layout) -> dict:
    """``ray.train.ScalingConfig``'s arguments for ``layout``: one worker per rank, each
    reserving the spec's resources, packed onto as few nodes as hold them."""
    req = spec.resources_per_worker
    resources = {"CPU": req.CPU, **({"GPU": req.GPU} if req.GPU else {}), **req.custom}
    return {"num_workers": layout.world_size, "use_gpu": req.GPU > 0,
            "resources_per_worker": resources, "placement_strategy": "PACK"}


def check_fits(layout: Layout, spec: JobSpec, nodes: list[NodeInfo]) -> None:
    """Refuse, with the reason, a stored layout that the cluster cannot hold now: its
    ``nodes`` nodes must each fit its ``workers_per_node`` workers of the spec."""
    wanted, per_node = layout.nodes, layout.workers_per_node
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


def search_tp(per_node: int, attempt, *, refused=(PlacementError,)):
    """``layout.tp: auto``'s one search: T over the divisors of a node's workers,
    smallest first. ``attempt(T)`` returns ``(result, need)``: ``need`` None where the
    result is good (the search stops there), else the bytes it lacks; a degree it
    refuses (``refused``) is passed over with its reason. Returns ``(result, tried,
    fits)``: the first good result, else the one that needs the least (None where
    every degree was refused); ``tried`` says why each smaller degree was passed over."""
    tried, best = [], None
    for T in (d for d in range(1, per_node + 1) if per_node % d == 0):
        try:
            result, need = attempt(T)
        except refused as e:
            tried.append((T, str(e)))
            continue
        if need is None:
            return result, tried, True
        tried.append((T, need))
        if best is None or need < best[1]:
            best = (result, need)
    return (best and best[0]), tried, False

