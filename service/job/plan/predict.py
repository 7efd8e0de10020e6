"""Per-rank predictions for a layout: the model built on the meta device as the workers
build it, ``dmuon.partition``, and per rank the owned elements and NS FLOPs, the tensor
bytes by kind (the kinds ``dmuon.memory_report`` measures), the bytes per step by mesh
dim and phase (what ``dmuon.get_ledger`` counts), with a communication time from
per-link bandwidths; and the mode (``dmuon.mode: auto``) they imply. Under tensor
parallelism every rank (r, s, t) of a TP group gets its TP shards' share
(``service.job.plan.tp_costs``) and the ``tp`` dim's bytes, timed on the node's link; ``tp: auto``
and ``mode: auto`` choose together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch

import dmuon
from dmuon import planning

from ..layout import Layout
from ..models.dtypes import DTYPES
from ..models.experts import is_expert
from ..models.source import BUILTIN, ModelSource
from ..plan_document import RankPrediction
from ..spec import JobSpec, SpecError
from .ep_costs import MoEShape, check_ep_boundaries, ep_ledger, moe_shape, resolve_ep
from .inventory import NodeInfo
from .layout_choice import (
    PlacementError,
    choose_layout,
    fsdp2_rows,
    nodes_and_workers,
    scaling_kwargs,
    search_tp,
    spec_tp,
)
from .modes import DEFAULT_CPU_GB, DEFAULT_GPU_GB, GB, ModeChoice, activation_bytes, decide
from .tp_costs import TPView, activation_traffic, annotate, gram_bytes, local_plan, tp_view

# Defaults per link kind, bytes/s (overridable): NVLink 4 on H100 moves 450 GB/s per
# direction; one 400 Gb/s InfiniBand NDR port per GPU moves 50 GB/s. Loopback is a guess.
BANDWIDTH = {"nvlink": 450e9, "infiniband": 50e9, "loopback": 5e9}


@dataclass
class Placement:
    """A layout's predictions: the ``Layout`` (its EP degree the partition's), the
    stored partition, every rank's prediction, the Muon/AdamW split and the mode."""

    spec: JobSpec
    layout: Layout
    plan: dmuon.DedicationPlan  # the stored partition: global shapes, ``tp_size`` T
    ranks: list[RankPrediction]
    split: dict = field(default_factory=dict)  # which params got Muon, which AdamW
    modes: ModeChoice | None = None
    local: dmuon.DedicationPlan | None = None  # the partition as one TP rank holds it

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def scaling_config_kwargs(self) -> dict:
        return scaling_kwargs(self.spec, self.layout)

    def table(self) -> str:
        T, P, n = self.layout.tp, self.layout.ep, self.layout.nodes
        dims = "replicate x shard" + (" x tp" if T > 1 else "")
        coord = "(r,s,t)" if T > 1 else "(r,s)"
        nodes = f"{n} node" + ("" if n == 1 else "s")
        peak = f"peak GB ({self.modes.dmuon.upper() if self.modes else 'Z3'})"
        lines = [f"layout {self.layout.shown()} ({dims}) on {nodes}; "
                 f"imbalance {self.plan.imbalance:.4f}",
                 f"{'rank':>5} {coord:>9}" + (f" {'ep':>3}" if P > 1 else "")
                 + f" {'owned elts':>14} {'NS TFLOP':>9} "
                 f"{'owned+mom GB':>12} {'Z2 packed GB':>12} {peak:>12} "
                 f"{'shard GB/step':>13} {'repl GB/step':>12}"
                 + (f" {'tp GB/step':>10}" if T > 1 else "")
                 + (f" {'ep GB/step':>10}" if P > 1 else "") + f" {'comm s':>8}"]
        for r in self.ranks:
            moved = {d: sum(r.ledger.get(d, {}).values())
                     for d in ("shard", "replicate", "tp", "ep")}
            where = "(" + ",".join(map(str, r.coord)) + ")"
            lines.append(
                f"{r.rank:>5} {where:>9}" + (f" {r.coord[1] % P:>3}" if P > 1 else "")
                + f" {r.owned_elements:>14,} {r.ns_flops / 1e12:>9.2f}"
                f" {(r.memory['owned_params'] + r.memory['momentum']) / 1e9:>12.2f}"
                f" {self.z2_packed_bytes / 1e9:>12.2f} {r.packed_peak / 1e9:>12.2f}"
                f" {moved['shard'] / 1e9:>13.2f} {moved['replicate'] / 1e9:>12.2f}"
                + (f" {moved['tp'] / 1e9:>10.2f}" if T > 1 else "")
                + (f" {moved['ep'] / 1e9:>10.2f}" if P > 1 else "")
                + f" {r.comm_seconds:>8.4f}")
        return "\n".join(lines)

    @property
    def z2_packed_bytes(self) -> int:
        plan = self.local if self.local is not None else self.plan
        return plan.total_elements * DTYPES[self.spec.precision.compute].itemsize


def _fsdp_bytes(shapes: list[tuple], n: int, rank: int, elt: int) -> tuple[int, int]:
    """(FSDP2 shard storage, AdamW state) bytes: FSDP2 pads dim 0 to a multiple of N
    and keeps each shard in a padded buffer; AdamW's zeros_like sees the unpadded rows.
    Under TP the shapes are the TP shards' (FSDP2 shards a TP shard's rows)."""
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


def _dmuon_bytes(spec: JobSpec, model, split) -> tuple[int, int, dict]:
    """(DMuon's param and reduce bytes per element, the hook boundaries' own
    ``{boundary: (param, reduce)}``). A ``param_policy`` that sets dtypes is DMuon's own
    precision (``dmuon.fully_shard`` then leaves it FSDP2's policy alone): its boundaries
    gather in their ``param_dtype`` and reduce in their ``grad_dtype`` (else the
    ``param_dtype``), the others in the master dtype."""
    elt, master, reduce = _bytes_of(spec)
    own = {} if split.param_policy is None else planning.boundary_dtypes(
        model, predicate=split.selected, param_policy=split.param_policy,
        hook_boundary_predicate=split.boundary_predicate(model))
    if not own:
        return elt, reduce, {}
    return master, master, {b: (p.itemsize if p else master, (g or p).itemsize if g or p
                                else master) for b, (p, g) in own.items()}


def _clip_bytes(spec: JobSpec, n: int, r: int, master: int, t: int = 1) -> dict[str, Fraction]:
    """clip_grad_norm_'s all-reduce of two squared norms (ledger phase ``step``), on the
    shard, replicate and (under TP) tp groups."""
    if spec.clip_grad_norm is None:
        return {}
    size = 2 * max(master, 4)
    out = {"shard": Fraction(2 * (n - 1), n) * size}
    if r > 1:
        out["replicate"] = Fraction(2 * (r - 1), r) * size
    if t > 1:
        out["tp"] = Fraction(2 * (t - 1), t) * size
    return out


def _row_moments(spec: JobSpec) -> bool:
    """NorMuon keeps a second moment per row of each owned matrix (``dmuon.normuon``)."""
    return spec.optimizer.variant == "normuon"


def _gram_elt(spec: JobSpec, master: int) -> int:
    """Bytes per element of the Gram matrices NS over TP shards all-reduces: the spec's
    ``ns_gram_dtype``, else its ``ns_dtype``, else ``dmuon``'s default (fp16 for Gram NS
    on GPUs, the update's own dtype on CPUs)."""
    o = spec.optimizer
    name = o.ns_gram_dtype or o.ns_dtype
    if name is not None:
        return DTYPES[name].itemsize
    if spec.resources_per_worker.GPU:
        return 2
    return master


class MetaModel:
    """The job's model on the meta device, built on first use and then kept: a plan
    partitions the one model for every layout it weighs (``tp: auto``'s degrees, an
    elastic range's node counts), since only the partition depends on the layout."""

    def __init__(self, spec: JobSpec, source: ModelSource | None):
        self.spec, self.source, self._prepared = spec, source, None

    @classmethod
    def of(cls, spec: JobSpec, source) -> MetaModel:
        """``source`` itself when it is one already, else a new one for it."""
        return source if isinstance(source, MetaModel) else cls(spec, source)

    def prepared(self):
        if self._prepared is None:  # an ImportError leaves it unbuilt: said again
            from ..models.build import prepare_on_meta

            self._prepared = prepare_on_meta(self.spec, self.source or BUILTIN,
                                             DTYPES[self.spec.precision.master_dtype])
        return self._prepared


def _model_and_plan(spec: JobSpec, source, layout: Layout):
    """(model on meta, its Muon/AdamW split, the partition, its TP view, its MoE shape,
    the layout with the EP degree resolved on the model) as the workers will make them;
    a TP degree the model refuses is a SpecError naming ``layout.tp``. ``source``: the
    model's source, or the plan's ``MetaModel`` built once."""
    prepared = MetaModel.of(spec, source).prepared()
    model, split = prepared.model, prepared.split
    embed = _embedding(model)
    T = layout.tp
    view = checked_tp_view(model, T, prepared.blocks, embed.embedding_dim if embed else 0,
                           embed.num_embeddings if embed else 0)
    moe = moe_shape(model, split.predicate)
    ep = resolve_ep(spec, layout.shard, moe)
    if ep != layout.ep:  # ep: auto, which only the model answers
        layout = layout.replace(ep=ep)
    check_ep_boundaries(model, split, ep)
    plan = dmuon.partition(model, predicate=split.selected, shard_size=layout.shard,
                           replicate_size=layout.replicate,
                           hook_boundary_predicate=split.boundary_predicate(model),
                           experts=is_expert, ep_size=ep, param_policy=split.param_policy)
    annotate(plan, view.splits, T)
    return model, split, plan, view, moe, layout


def checked_tp_view(model, T: int, blocks: list[str], hidden: int, vocab: int) -> TPView:
    """``tp_view``, a TP degree the model refuses being a SpecError naming ``layout.tp``
    (the planner's and the pipeline planner's one wording)."""
    try:
        return tp_view(model, T, blocks, hidden, vocab)
    except ValueError as e:
        raise SpecError(f"layout.tp: {str(e).removeprefix('layout.')}") from None


def _embedding(model):
    return next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)


def predict(spec: JobSpec, nodes: list[NodeInfo], *, intra_link="nvlink",
            inter_link="infiniband", bandwidth=None,
            model_source: ModelSource | MetaModel | None = None,
            layout: Layout | None = None) -> Placement:
    """Choose the layout (``tp: auto``: the smallest T that runs) and the mode, and
    predict what every rank holds and moves per step (DMuon's share from ``dmuon.planning``
    on each TP rank's shards, FSDP2's from the padded shards, TP's from the plan's
    styles). ``layout``: the one chosen already (a stored plan's, an elastic count's)."""
    model_source = MetaModel.of(spec, model_source)  # one build for every T tried
    if layout is None and spec_tp(spec) is None:
        return _choosing_tp(spec, nodes, intra_link=intra_link, inter_link=inter_link,
                            bandwidth=bandwidth, model_source=model_source)
    layout = layout or choose_layout(nodes, spec)
    model, split, plan, view, moe, layout = _model_and_plan(spec, model_source, layout)
    R, N, T = layout.replicate, layout.shard, layout.tp
    local = local_plan(plan, view.splits, T)
    others = view.local_shapes(model, [n for n, _ in model.named_parameters()
                                       if not split.predicate(n)])
    dmuon_bytes = _dmuon_bytes(spec, model, split)
    modes = choose_mode(spec, model, split, local, others, nodes, N, view, dmuon_bytes)
    spans_nodes = N * T > layout.workers_per_node  # a shard group over several nodes
    ep_in_node = layout.workers_per_node % (layout.ep * T) == 0
    links = {"shard": inter_link if spans_nodes else intra_link if N > 1 else "loopback",
             "replicate": inter_link, "tp": intra_link,
             "ep": intra_link if ep_in_node else inter_link}
    bw = {dim: {**BANDWIDTH, **(bandwidth or {})}[link] for dim, link in links.items()}
    ranks = _ranks(spec, plan, local, others, modes, view, (R, N), layout.batch, bw, moe,
                   dmuon_bytes)
    return Placement(spec, layout, plan, ranks, split.to_dict(), modes, local=local)


def _tp_ledger(spec: JobSpec, plan, view: TPView, slot: int,
               batch: tuple[int, int], master: int) -> dict[str, Fraction]:
    """``{phase: bytes}`` on the ``tp`` dim per step: the activation conversions of every
    micro-batch and the Gram all-reduces (or gathers) of the slot's matrices."""
    elt = _bytes_of(spec)[0]
    micros, rows = batch
    act = activation_traffic(view.convs, tokens=rows * spec.seq_len, elt=elt, T=view.T,
                             checkpointing=spec.activation_checkpointing)
    out = {k: v * micros for k, v in act.items()}
    gram = gram_bytes(plan, slot, view.T, gram_elt=_gram_elt(spec, master),
                      master_elt=master, steps=spec.optimizer.ns_steps)
    # the step's flags are summed over TP as over the DP dims (every peer skips alike)
    flags = Fraction(2 * (view.T - 1), view.T) * planning.presence_flags(plan) \
        * planning.PRESENCE_BYTES
    out["step"] = gram + flags
    return out


def _ranks(spec: JobSpec, plan, local, others, modes: ModeChoice, view: TPView,
           dp: tuple[int, int], batch: tuple[int, int], bw: dict,
           moe: MoEShape | None, dmuon_bytes: tuple) -> list[RankPrediction]:
    """Every rank's prediction, rank ``(r * N + s) * T + t`` at (r, s[, t]);
    ``dmuon_bytes``: ``_dmuon_bytes``'s."""
    (R, N), T = dp, view.T
    elt, master, _ = _bytes_of(spec)
    param, reduce, own = dmuon_bytes
    z3 = modes.dmuon == "z3"
    peak = planning.packed_peak_bytes(local, z3=z3, prefetch=1, param_bytes=param,
                                      boundary_bytes=own)
    clip = _clip_bytes(spec, N, R, master, T)
    # each a pass over every unit of the plan: once, not once per rank
    elements, flops = local.elements_per_rank, local.ns_flops_per_rank
    ranks = []
    for rank in range(R * N * T):
        slot, t = divmod(rank, T)
        r, s = divmod(slot, N)
        fsdp, adamw = _fsdp_bytes(others, N, s, master)
        ledger = planning.ledger_prediction(local, slot, z3=z3, param_bytes=param,
                                            reduce_bytes=reduce, boundary_bytes=own)
        if T > 1:
            ledger["tp"] = _tp_ledger(spec, plan, view, slot, batch, master)
        if moe is not None and plan.ep_size > 1:  # under TP each rank sends its group's tokens
            ledger["ep"] = ep_ledger(moe, plan.ep_size, tokens=batch[1] * spec.seq_len,
                                     micros=batch[0], elt=elt,
                                     checkpointing=spec.activation_checkpointing != "none")
        for dim, extra in clip.items():
            ledger[dim]["step"] = Fraction(ledger[dim].get("step", 0)) + extra
        ledger = {d: {k: planning.exact(Fraction(v)) for k, v in p.items()}
                  for d, p in ledger.items()}
        memory = {**planning.memory_prediction(local, slot, z3=z3, param_bytes=param,
                                               master_bytes=master,
                                               row_moments=_row_moments(spec),
                                               boundary_bytes=own),
                  "fsdp_shards": fsdp, "adamw_state": adamw}
        seconds = sum(sum(phases.values()) / bw[d] for d, phases in ledger.items())
        ranks.append(RankPrediction(
            rank=rank, coord=(r, s, t) if T > 1 else (r, s),
            owned_elements=elements[slot], ns_flops=flops[slot], memory=memory,
            packed_peak=peak,
            ledger=ledger, comm_seconds=seconds))
    return ranks


def device_bytes(spec: JobSpec, nodes: list[NodeInfo], per_node: int) -> int:
    """The memory of one worker's device: the spec's, 80 GB per GPU worker, else the
    node's memory shared by its workers (Ray's ``memory`` resource)."""
    if spec.dmuon.device_memory_gb is not None:
        return int(spec.dmuon.device_memory_gb * GB)
    if spec.resources_per_worker.GPU:
        return int(DEFAULT_GPU_GB * GB)
    memory = min((n.resources.get("memory", 0) for n in nodes), default=0)
    return int(memory / max(1, per_node)) if memory else int(DEFAULT_CPU_GB * GB)


def choose_mode(spec: JobSpec, model, split, plan, others, nodes, shard: int,
                view: TPView | None, dmuon_bytes: tuple) -> ModeChoice:
    """The mode to run (``auto``: the seeds' tree on one rank's worst-case memory).
    ``plan`` and ``others``: as one TP rank holds them (``view``: the TP degree);
    ``dmuon_bytes``: ``_dmuon_bytes``'s."""
    elt, master, _ = _bytes_of(spec)
    param, _, own = dmuon_bytes
    T = view.T if view is not None else 1
    world = plan.world_size
    embed = _embedding(model)
    act = activation_bytes(tokens=spec.batch_size * spec.seq_len,
                           hidden=embed.embedding_dim if embed else 0,
                           layers=len(split.fsdp_units),
                           vocab=embed.num_embeddings if embed else 0, elt=elt,
                           checkpointed=spec.activation_checkpointing != "none", tp=T,
                           logits_split=view.logits_split if view is not None else 1)
    gathered_others = sum(math.prod(s) for s in others) * elt
    fsdp_by_index = [_fsdp_bytes(others, shard, s, master) for s in range(shard)]
    elements = plan.elements_per_rank  # a pass over every unit: once, not once per rank
    # the worst rank's bytes less its packed buffers are the same under Z2 and Z3 (the
    # kinds but packed_buffers do not depend on z3): one pass over the ranks for both
    worst = 0
    for rank in range(world):
        fsdp, adamw = fsdp_by_index[rank % shard]
        held = planning.memory_prediction(plan, rank, z3=True, param_bytes=param,
                                          master_bytes=master, row_moments=_row_moments(spec),
                                          boundary_bytes=own)
        grads = elements[rank] * master + fsdp
        worst = max(worst, sum(held.values()) - held["packed_buffers"] + fsdp + adamw
                    + grads)
    totals = {z3: worst + planning.packed_peak_bytes(plan, z3=z3, prefetch=1,
                                                     param_bytes=param, boundary_bytes=own)
              + gathered_others + act for z3 in (False, True)}
    per_node = -(-world * T // max(1, len(nodes)))
    params = sum(p.numel() for p in model.parameters())
    return decide(spec.dmuon, params=params, gpus=world * T, shard=shard,
                  device_bytes=device_bytes(spec, nodes, per_node), z2_bytes=totals[False],
                  z3_bytes=totals[True], resident_pm=plan.total_elements * elt,
                  device="GPU" if spec.resources_per_worker.GPU else "CPU")


def needed_bytes(modes: ModeChoice) -> int:
    """One rank's peak in the mode chosen."""
    return modes.z3_bytes if modes.dmuon == "z3" else modes.z2_bytes


def _choosing_tp(spec: JobSpec, nodes: list[NodeInfo], **kwargs) -> Placement:
    """``layout.tp: auto``: the smallest T (dividing a node's workers, accepted by the
    model) with which the global batch splits and a rank fits its memory; where none
    fits, the T that needs the least. The choice and the degrees passed over are said
    in the mode's reason."""
    _, per_node = nodes_and_workers(nodes, spec)

    def attempt(T: int):
        placement = predict(spec, nodes, layout=choose_layout(nodes, spec, T), **kwargs)
        return placement, None if placement.modes.fits else needed_bytes(placement.modes)

    best, tried, fits = search_tp(per_node, attempt, refused=(PlacementError, SpecError))
    passed = [f"T={T}: " + (why.removeprefix("layout.tp: ") if isinstance(why, str)
                            else f"a rank needs {why / GB:.1f} GB") for T, why in tried]
    if best is None:
        raise SpecError("layout.tp: auto: no tensor-parallel degree can run: "
                        + "; ".join(passed))
    if fits:
        return _with_tp_reason(best, "the smallest that fits "
                               f"({needed_bytes(best.modes) / GB:.1f} GB per rank)", passed)
    return _with_tp_reason(best, "none fits; the one that needs the least", passed)


def _with_tp_reason(placement: Placement, why: str, tried: list[str]) -> Placement:
    m = placement.modes
    over = f" (passed over: {'; '.join(tried)})" if tried else ""
    m.reason = f"{m.reason}; layout.tp: auto chose T={placement.layout.tp}, {why}{over}"
    return placement
