"""Per-rank predictions for a layout: the model built on the meta device as the workers
build it, ``dmuon.partition``, and per rank the owned elements and NS FLOPs, the tensor
bytes by kind (the kinds ``dmuon.memory_report`` measures), the bytes per step by mesh
dim and phase (what ``dmuon.get_ledger`` counts), with a communication time from
per-link bandwidths; and the mode (``dmuon.mode: auto``) they imply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch

import dmuon
from dmuon import cost

from ..cluster import NodeInfo
from ..models.dtypes import DTYPES
from ..models.source import BUILTIN, ModelSource
from ..spec import JobSpec, SpecError
from .document import RankPrediction
from .layout import batch_split, choose_layout, fsdp2_rows
from .modes import DEFAULT_CPU_GB, DEFAULT_GPU_GB, GB, ModeChoice, activation_bytes, decide

# Defaults per link kind, bytes/s (overridable): NVLink 4 on H100 moves 450 GB/s per
# direction; one 400 Gb/s InfiniBand NDR port per GPU moves 50 GB/s. Loopback is a guess.
BANDWIDTH = {"nvlink": 450e9, "infiniband": 50e9, "loopback": 5e9}


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


def _model_and_plan(spec: JobSpec, source: ModelSource | None, R: int, N: int):
    """(model on meta, its Muon/AdamW split, the partition) as the workers will make them."""
    from ..models.build import prepare_on_meta

    prepared = prepare_on_meta(spec, source or BUILTIN, DTYPES[spec.precision.master_dtype])
    model, split = prepared.model, prepared.split
    plan = dmuon.partition(model, predicate=split.predicate, shard_size=N, replicate_size=R,
                           hook_boundary_predicate=split.boundary_predicate(model))
    return model, split, plan


def predict(spec: JobSpec, nodes: list[NodeInfo], *, intra_link="nvlink",
            inter_link="infiniband", bandwidth=None, model_inputs: ModelSource | None = None,
            layout: tuple[int, int, int] | None = None) -> Placement:
    """Choose the layout and the mode, and predict what every rank holds and moves per
    step (DMuon's share from ``dmuon.cost``, FSDP2's from the padded shards)."""
    n_nodes, R, N = layout or choose_layout(nodes, spec)
    try:  # refused here, before any worker starts
        batch_split(spec, R * N)
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
            ledger[dim]["step"] = cost.exact(Fraction(ledger[dim].get("step", 0)) + extra)
        memory = {**cost.memory_prediction(plan, rank, z3=z3, param_bytes=elt,
                                           master_bytes=master),
                  "fsdp_shards": fsdp, "adamw_state": adamw}
        seconds = (sum(ledger["shard"].values()) / bw[intra_link if N > 1 else "loopback"]
                   + sum(ledger.get("replicate", {}).values()) / bw[inter_link])
        ranks.append(RankPrediction(
            rank=rank, coord=(r, s), owned_elements=plan.elements_per_rank[rank],
            ns_flops=plan.ns_flops_per_rank[rank], memory=memory, packed_peak=peak,
            ledger=ledger, comm_seconds=seconds))
    return Placement(spec, n_nodes, R, N, plan, ranks, split.to_dict(), modes)


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
