"""Placement planner: cluster inventory + job spec -> HSDP layout and per-rank predictions.

The layout is R x N (replicate x shard): replicate across nodes, shard within a node,
unless the spec asks for a factorisation. Predictions come from the model built on the
meta device and ``dmuon.partition``, so a 70B plan needs no memory: per rank, owned
elements and NS FLOPs, tensor bytes by kind (the kinds ``dmuon.memory_report``
measures), and bytes per step by mesh dim and phase (what ``dmuon.get_ledger`` counts),
with a communication time from per-link bandwidths.

    python -m service.planner --model llama3-70b --nodes 8 --gpus-per-node 8
"""

from __future__ import annotations

import argparse
import json
import math
import threading
from dataclasses import dataclass, field
from fractions import Fraction

import torch

import dmuon

from .mode_choice import DEFAULT_CPU_GB, DEFAULT_GPU_GB, GB, ModeChoice, activation_bytes, decide
from .plan.document import Inventory, Layout, PlanDocument
from .spec import JobSpec, SpecError, parse_spec
from .train.dtypes import DTYPES
from .train.mesh import fsdp2_rows
from .train.recipe import micro_batches

# Defaults per link kind, bytes/s (overridable): NVLink 4 on H100 moves 450 GB/s per
# direction; one 400 Gb/s InfiniBand NDR port per GPU moves 50 GB/s. Loopback is a guess.
BANDWIDTH = {"nvlink": 450e9, "infiniband": 50e9, "loopback": 5e9}


class PlacementError(ValueError):
    """A layout that cannot run on this cluster; the message says why."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    cpus: float
    gpus: float
    resources: dict = field(default_factory=dict)


def inventory_from_ray() -> list[NodeInfo]:
    """The alive nodes of the connected Ray cluster with their logical resources."""
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        nodes.append(NodeInfo(n["NodeID"], n["NodeManagerAddress"], res.get("CPU", 0),
                              res.get("GPU", 0), dict(res)))
    return nodes


def inventory_from_dashboard(address: str, timeout_s: float = 5) -> list[NodeInfo]:
    """The same, read through the Ray dashboard at ``address`` by Ray's state API: for the
    control plane, which is not a Ray driver."""
    from ray.util.state import list_nodes

    return [NodeInfo(n.node_id, n.node_ip, n.resources_total.get("CPU", 0),
                     n.resources_total.get("GPU", 0), dict(n.resources_total))
            for n in list_nodes(address=address, detail=True, timeout=int(timeout_s),
                                raise_on_missing_output=False)
            if n.state == "ALIVE"]


def synthetic_inventory(nodes: int, gpus_per_node: int, cpus_per_node: int = 64):
    return [NodeInfo(f"node{i}", f"10.0.0.{i}", cpus_per_node, gpus_per_node)
            for i in range(nodes)]


MAX_WORKERS = 16384  # per job: far past any cluster we plan for, and a plan stays quick


def _slots(node: NodeInfo, spec: JobSpec) -> int:
    """How many workers of ``spec.resources_per_worker`` fit on ``node`` (at most 1024)."""
    req = spec.resources_per_worker
    fits = [node.cpus // req.CPU if req.CPU else math.inf,
            node.gpus // req.GPU if req.GPU else math.inf]
    fits += [node.resources.get(k, 0) // v for k, v in req.custom.items() if v]
    n = min(fits)
    return 0 if n == math.inf else int(min(n, 1024))


def choose_layout(nodes: list[NodeInfo], spec: JobSpec) -> tuple[int, int, int]:
    """(nodes used, R, N). Refuses uneven or impossible layouts with the reason."""
    lay = spec.layout
    usable = [n for n in nodes if _slots(n, spec) > 0]
    if not usable:
        raise PlacementError(f"no node fits one worker needing {spec.resources_per_worker}")
    n_nodes = len(usable) if lay.nodes == "auto" else lay.nodes
    if n_nodes > len(usable):
        raise PlacementError(f"layout.nodes={n_nodes} but only {len(usable)} nodes fit a worker")
    per_node = min(_slots(n, spec) for n in usable[:n_nodes])
    if lay.workers_per_node != "auto":
        if lay.workers_per_node > per_node:
            raise PlacementError(
                f"layout.workers_per_node={lay.workers_per_node} but a node fits only "
                f"{per_node} workers of {spec.resources_per_worker.model_dump()}")
        per_node = lay.workers_per_node
    total = n_nodes * per_node
    if total > MAX_WORKERS:
        raise PlacementError(f"{n_nodes} nodes x {per_node} workers = {total} workers; a job "
                             f"may have at most {MAX_WORKERS}")
    cluster_cpus = sum(n.cpus for n in nodes)
    if total * spec.resources_per_worker.CPU > cluster_cpus:
        raise PlacementError(f"{total} workers need more than the cluster's {cluster_cpus:g} CPUs")
    R, N = n_nodes, per_node
    if lay.replicate is not None or lay.shard is not None:
        R = lay.replicate or total // lay.shard
        N = lay.shard or total // lay.replicate
        if R * N != total:
            raise PlacementError(
                f"{R} x {N} = {R * N} workers cannot be split evenly over {n_nodes} nodes of "
                f"{per_node} workers ({total} in all)")
        if per_node % N and N % per_node:
            raise PlacementError(
                f"shard size N={N} must divide or be a multiple of {per_node} workers per "
                "node, so that shard groups do not straddle nodes unevenly")
    return n_nodes, R, N


def check_fits(layout: Layout, spec: JobSpec, nodes: list[NodeInfo]) -> None:
    """Refuse, with the reason, a stored layout that the cluster cannot hold now: its
    ``nodes`` nodes must each fit ``replicate * shard / nodes`` workers of the spec."""
    world, wanted = layout.world_size, layout.nodes
    per_node = -(-world // wanted)
    fitting = [n for n in nodes if _slots(n, spec) >= per_node]
    if len(fitting) < wanted:
        raise PlacementError(
            f"the stored plan ({layout.replicate} x {layout.shard} on {wanted} "
            f"node(s), {per_node} workers of {spec.resources_per_worker.model_dump()} each) "
            f"no longer fits: {len(fitting)} of the cluster's {len(nodes)} alive node(s) "
            f"can hold {per_node} workers")


def plan_document(spec: JobSpec, cluster: list[NodeInfo] | None, assumed_cpus: int,
                  model_inputs: dict | None = None) -> PlanDocument:
    """``_plan_document`` for this spec and cluster, computed once: submissions come in
    bursts of the same spec (retries, sweeps), and a plan builds a model."""
    key = (spec.model_dump_json(), repr(cluster), assumed_cpus, json.dumps(model_inputs))
    with _PLANS_LOCK:
        cached = _PLANS.get(key)
    if cached is None:
        cached = _plan_document(spec, cluster, assumed_cpus, model_inputs).model_dump_json()
        with _PLANS_LOCK:
            _PLANS[key] = cached
            while len(_PLANS) > 64:
                _PLANS.pop(next(iter(_PLANS)))
    return PlanDocument.model_validate_json(cached)


_PLANS: dict[tuple, str] = {}
_PLANS_LOCK = threading.Lock()


def _plan_document(spec: JobSpec, cluster: list[NodeInfo] | None, assumed_cpus: int,
                   model_inputs: dict | None = None) -> PlanDocument:
    """The plan as stored with a job and run by its entrypoint: layout, per-rank
    predictions, the partition, and the nodes it was planned on. Those are the attached
    cluster's when the job fits them now; else (no cluster, or one that must grow first)
    ``layout.nodes`` assumed nodes of ``assumed_cpus`` CPUs, with the reason."""
    try:
        if not cluster:
            raise PlacementError("no Ray cluster attached" if cluster is None else
                                 "the Ray cluster lists no alive node")
        layout = choose_layout(cluster, spec)
        nodes, inventory = cluster, {"source": "cluster", "nodes": len(cluster)}
    except PlacementError as on_cluster:
        count = spec.layout.nodes if spec.layout.nodes != "auto" else 1
        nodes = synthetic_inventory(count, 0, cpus_per_node=assumed_cpus)
        layout = choose_layout(nodes, spec)
        inventory = {"source": "assumed", "nodes": count, "cpus_per_node": assumed_cpus,
                     "reason": str(on_cluster)}
    try:
        placement = predict(spec, nodes, model_inputs=model_inputs, layout=layout)
    except ImportError as e:  # a factory importable only from the job's working_dir
        return deferred_document(spec, layout, inventory, f"{type(e).__name__}: {e}")
    return placement_document(placement, inventory)


def placement_document(placement: Placement, inventory: dict) -> PlanDocument:
    return PlanDocument(
        layout=Layout(replicate=placement.replicate, shard=placement.shard,
                      nodes=placement.nodes),
        inventory=Inventory(**inventory), modes=placement.modes.to_dict(),
        param_groups=placement.split, ranks=[r.__dict__ for r in placement.ranks],
        partition=placement.plan.to_dict(), scaling=placement.scaling_config_kwargs())


def deferred_document(spec: JobSpec, layout: tuple[int, int, int], inventory: dict,
                      reason: str) -> PlanDocument:
    """The layout alone, for a model only the job's own processes can import: the job's
    entrypoint completes the plan (partition, mode) once, before any worker starts, and
    stores it with the job."""
    n_nodes, R, N = layout
    placement = Placement(spec, n_nodes, R, N, None, [])
    return PlanDocument(
        layout=Layout(replicate=R, shard=N, nodes=n_nodes), inventory=Inventory(**inventory),
        deferred=f"the model cannot be built here ({reason}); the job plans it",
        scaling=placement.scaling_config_kwargs())


@dataclass
class RankPrediction:
    rank: int
    coord: tuple[int, int]
    owned_elements: int
    ns_flops: int
    memory: dict[str, int]  # dmuon.MEMORY_KINDS at rest after a step
    packed_peak: int  # packed-buffer bytes at the worst hook
    ledger: dict[str, dict[str, int]]  # {dim: {phase: bytes per step}}
    comm_seconds: float


@dataclass
class Placement:
    spec: JobSpec
    nodes: int
    replicate: int
    shard: int
    plan: dmuon.DedicationPlan
    ranks: list[RankPrediction]
    split: dict = field(default_factory=dict)  # which params got Muon, which AdamW
    modes: ModeChoice | None = None

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard

    def scaling_config_kwargs(self) -> dict:
        req = self.spec.resources_per_worker
        resources = {"CPU": req.CPU, **({"GPU": req.GPU} if req.GPU else {}), **req.custom}
        return {"num_workers": self.world_size, "use_gpu": req.GPU > 0,
                "resources_per_worker": resources, "placement_strategy": "PACK"}

    def scaling_config(self):
        from ray.train import ScalingConfig

        return ScalingConfig(**self.scaling_config_kwargs())

    def table(self) -> str:
        lines = [f"layout {self.replicate} x {self.shard} (replicate x shard) on {self.nodes} "
                 f"nodes; imbalance {self.plan.imbalance:.4f}",
                 f"{'rank':>5} {'(r,s)':>7} {'owned elts':>14} {'NS TFLOP':>9} "
                 f"{'owned+mom GB':>12} {'Z2 packed GB':>12} {'Z3 peak GB':>10} "
                 f"{'shard GB/step':>13} {'repl GB/step':>12} {'comm s':>8}"]
        for r in self.ranks:
            shard = sum(r.ledger.get("shard", {}).values())
            repl = sum(r.ledger.get("replicate", {}).values())
            lines.append(
                f"{r.rank:>5} {str(r.coord):>7} {r.owned_elements:>14,} {r.ns_flops / 1e12:>9.2f}"
                f" {(r.memory['owned_params'] + r.memory['momentum']) / 1e9:>12.2f}"
                f" {self.z2_packed_bytes / 1e9:>12.2f} {r.packed_peak / 1e9:>10.2f}"
                f" {shard / 1e9:>13.2f} {repl / 1e9:>12.2f} {r.comm_seconds:>8.4f}")
        return "\n".join(lines)

    @property
    def z2_packed_bytes(self) -> int:
        return self.plan.total_elements * DTYPES[self.spec.precision.compute].itemsize


def _fsdp_bytes(shapes: list[tuple], n: int, rank: int, elt: int) -> tuple[int, int]:
    """(FSDP2 shard storage, AdamW state) bytes: FSDP2 pads dim 0 to a multiple of N
    and keeps each shard in a padded buffer; AdamW's zeros_like sees the unpadded rows."""
    storage = state = 0
    for shape in shapes:
        rows, rest = shape[0], math.prod(shape[1:])
        lo, hi = fsdp2_rows(rows, n, rank)
        mine = hi - lo
        storage += -(-rows // n) * rest * elt if mine else 0
        state += 2 * mine * rest * elt
    return storage, state


def _bytes_of(spec: JobSpec) -> tuple[int, int, int]:
    """(param, master, reduce) bytes per element under the spec's precision."""
    p = spec.precision
    return (DTYPES[p.compute].itemsize, DTYPES[p.master_dtype].itemsize,
            DTYPES[p.reduce].itemsize)


def _clip_bytes(spec: JobSpec, n: int, r: int, master: int) -> dict[str, Fraction]:
    """clip_grad_norm_'s all-reduce of two squared norms (ledger phase ``step``)."""
    if spec.clip_grad_norm is None:
        return {}
    size = 2 * max(master, 4)
    out = {"shard": Fraction(2 * (n - 1), n) * size}
    if r > 1:
        out["replicate"] = Fraction(2 * (r - 1), r) * size
    return out


def _model_and_plan(spec: JobSpec, model_inputs: dict | None, R: int, N: int):
    """(model on meta, its Muon/AdamW split, the partition) as the workers will make them."""
    from .train.build import prepare_on_meta

    prepared = prepare_on_meta(spec, model_inputs or {"kind": "builtin"},
                               DTYPES[spec.precision.master_dtype])
    model, split = prepared.model, prepared.split
    plan = dmuon.partition(model, predicate=split.predicate, shard_size=N, replicate_size=R,
                           hook_boundary_predicate=split.boundary_predicate(model))
    return model, split, plan


def predict(spec: JobSpec, nodes: list[NodeInfo], *, intra_link="nvlink",
            inter_link="infiniband", bandwidth=None, model_inputs: dict | None = None,
            layout: tuple[int, int, int] | None = None) -> Placement:
    """Choose the layout and the mode, and predict what every rank holds and moves per
    step (DMuon's share from ``dmuon.cost``, FSDP2's from the padded shards)."""
    from dmuon import cost

    n_nodes, R, N = layout or choose_layout(nodes, spec)
    try:  # refused here, before any worker starts
        micro_batches(spec, R * N)
    except ValueError as e:
        raise SpecError(str(e)) from None
    bw = {**BANDWIDTH, **(bandwidth or {})}
    model, split, plan = _model_and_plan(spec, model_inputs, R, N)
    elt, master, reduce = _bytes_of(spec)
    others = [tuple(p.shape) for n, p in model.named_parameters() if not split.predicate(n)]
    modes = choose_mode(spec, model, split, plan, others, nodes, N)
    z3 = modes.dmuon == "z3"
    peak = cost.packed_peak_bytes(plan, z3=z3, prefetch=1, param_bytes=elt)
    clip = _clip_bytes(spec, N, R, master)
    ranks = []
    for rank in range(R * N):
        r, s = divmod(rank, N)
        fsdp, adamw = _fsdp_bytes(others, N, s, master)
        ledger = cost.ledger_prediction(plan, rank, z3=z3, param_bytes=elt, reduce_bytes=reduce)
        for dim, extra in clip.items():
            ledger[dim]["step"] = _exact(ledger[dim].get("step", 0) + extra)
        memory = {**cost.memory_prediction(plan, rank, z3=z3, param_bytes=elt,
                                           master_bytes=master),
                  "fsdp_shards": fsdp, "adamw_state": adamw}
        seconds = (sum(ledger["shard"].values()) / bw[intra_link if N > 1 else "loopback"]
                   + sum(ledger.get("replicate", {}).values()) / bw[inter_link])
        ranks.append(RankPrediction(rank, (r, s), plan.elements_per_rank[rank],
                                    plan.ns_flops_per_rank[rank], memory, peak, ledger,
                                    seconds))
    return Placement(spec, n_nodes, R, N, plan, ranks, split.to_dict(), modes)


def _exact(value) -> int | float:
    value = Fraction(value)
    return int(value) if value.denominator == 1 else float(value)


def device_bytes(spec: JobSpec, nodes: list[NodeInfo], per_node: int) -> int:
    """The memory of one worker's device: the spec's, 80 GB per GPU worker, else the
    node's memory shared by its workers (Ray's ``memory`` resource)."""
    if spec.dmuon.device_memory_gb is not None:
        return int(spec.dmuon.device_memory_gb * GB)
    if spec.resources_per_worker.GPU:
        return int(DEFAULT_GPU_GB * GB)
    memory = min((n.resources.get("memory", 0) for n in nodes), default=0)
    return int(memory / max(1, per_node)) if memory else int(DEFAULT_CPU_GB * GB)


def choose_mode(spec: JobSpec, model, split, plan, others, nodes, shard: int) -> ModeChoice:
    """The mode to run (``auto``: the seeds' tree on one rank's worst-case memory)."""
    from dmuon import cost

    elt, master, _ = _bytes_of(spec)
    world = plan.world_size
    embed = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    act = activation_bytes(tokens=spec.batch_size * spec.seq_len,
                           hidden=embed.embedding_dim if embed else 0,
                           layers=len(split.fsdp_units),
                           vocab=embed.num_embeddings if embed else 0, elt=elt,
                           checkpointed=spec.activation_checkpointing != "none")
    gathered_others = sum(math.prod(s) for s in others) * elt
    fsdp_by_index = [_fsdp_bytes(others, shard, s, master) for s in range(shard)]
    totals = {}
    for z3 in (False, True):
        peak = cost.packed_peak_bytes(plan, z3=z3, prefetch=1, param_bytes=elt)
        worst = 0
        for rank in range(world):
            fsdp, adamw = fsdp_by_index[rank % shard]
            held = cost.memory_prediction(plan, rank, z3=z3, param_bytes=elt,
                                          master_bytes=master)
            grads = plan.elements_per_rank[rank] * master + fsdp
            worst = max(worst, sum(held.values()) - held["packed_buffers"] + fsdp + adamw
                        + grads)
        totals[z3] = worst + peak + gathered_others + act
    per_node = -(-world // max(1, len(nodes)))
    params = sum(p.numel() for p in model.parameters())
    return decide(spec.dmuon, params=params, gpus=world, shard=shard,
                  device_bytes=device_bytes(spec, nodes, per_node), z2_bytes=totals[False],
                  z3_bytes=totals[True], resident_pm=plan.total_elements * elt,
                  device="GPU" if spec.resources_per_worker.GPU else "CPU")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--mode", choices=("auto", "z2", "z3"), default="auto")
    ap.add_argument("--master-dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--param-dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--reduce-dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per GPU")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--device-memory-gb", type=float, default=DEFAULT_GPU_GB)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--nvlink-gbps", type=float, default=BANDWIDTH["nvlink"] / 1e9)
    ap.add_argument("--ib-gbps", type=float, default=BANDWIDTH["infiniband"] / 1e9)
    ap.add_argument("--ranks", type=int, default=8, help="rows to print (0: all)")
    args = ap.parse_args(argv)
    precision = {"master_dtype": args.master_dtype, "param_dtype": args.param_dtype,
                 "reduce_dtype": args.reduce_dtype}
    spec = parse_spec({"model": args.model, "precision": precision,
                       "batch_size": args.batch_size, "seq_len": args.seq_len,
                       "activation_checkpointing":
                           "non_reentrant" if args.activation_checkpointing else "none",
                       "dmuon": {"mode": args.mode, "device_memory_gb": args.device_memory_gb},
                       "resources_per_worker": {"CPU": 1, "GPU": 1}})
    placement = predict(spec, synthetic_inventory(args.nodes, args.gpus_per_node),
                        bandwidth={"nvlink": args.nvlink_gbps * 1e9,
                                   "infiniband": args.ib_gbps * 1e9})
    table = placement.table().splitlines()
    print("\n".join(table[:2 + args.ranks] if args.ranks else table))
    m = placement.modes
    print(f"P_M = {placement.plan.total_elements:,} elements; packed buffers per rank: "
          f"Z2 {placement.z2_packed_bytes / 1e9:.2f} GB resident, "
          f"Z3 {placement.ranks[0].packed_peak / 1e9:.2f} GB peak"
          if m.dmuon == "z3" else f"P_M = {placement.plan.total_elements:,} elements")
    print(f"mode {m.dmuon.upper()} (FSDP2 {m.fsdp.upper()}): {m.reason}; one rank needs "
          f"Z2 {m.z2_bytes / GB:.1f} GB, Z3 {m.z3_bytes / GB:.1f} GB of "
          f"{m.device_bytes / GB:.0f} GB")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
