"""The plan of a pipeline-parallel layout (``layout.pp`` > 1): the stage split
(``stages``), and per pp rank its ranks, stages, time, NS load, memory with its
micro-batches in flight and ``pp`` bytes, on the meta model. The document stores it as
``pipeline``; the mode is ``modes.decide``'s on the worst pp rank's peaks.

Per GPU of a stage (elements E of its Muon matrices, A of its AdamW params, over its
R x N data-parallel ranks and T TP ranks): DMuon's bf16 shard column E/T x param bytes
/ N and, apart from it when they differ, the master, the momentum and the gradient
E/T x master bytes / (R N); FSDP2's shards of the others A/T x master / N, AdamW's two
moments twice that, their gradient once; packed buffers Z2: every Muon unit of the
stage (an MoE layer's experts 1/P), Z3: the two largest consecutive layers; the others
gathered for forward, A/T x param bytes; activations ``modes.activation_bytes`` of the
stage's layers per micro-batch in flight, and on the last stage the logits of one
micro-batch, as ``predict`` counts them (1/T under TP's loss parallel, no second
recomputed block), so that pp 1 reads as ``predict``, which ``choose_pp`` weighs it
against. The states stay an even share per rank (``predict``: the worst rank of dmuon's
partition), within 1% of ``predict``'s at pp 1 (tests/job/test_pp_plan.py)."""

from __future__ import annotations

import dataclasses

from dmuon import ns_flops

from ..layout import Layout
from ..models.dtypes import DTYPES
from ..models.experts import experts_per_token, is_expert
from ..spec import JobSpec, SpecError
from .modes import HEADROOM, activation_bytes, decide
from .stage_split import Costs, Unit, best_split, bubble, count_split, in_flight, slowest


def model_units(model, split, blocks: list[str], spec: JobSpec) -> tuple[Unit, list[Unit], Unit]:
    """(embedding, layers, head) of a meta model: every param outside the blocks goes
    to the embedding's unit when it is under an ``nn.Embedding``, else to the head's."""
    import torch

    if not blocks:
        raise SpecError("layout.pp: the model has no repeated blocks to split into stages")
    depth, index = len(blocks[0].split(".")), {b: i for i, b in enumerate(blocks)}
    embeds = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    top_k = experts_per_token(model) or 0
    config = getattr(model, "config", None)
    width = ((getattr(config, "num_attention_heads", 0) or 0)
             * (getattr(config, "head_dim", 0) or 0)) or _hidden(model)
    o = spec.optimizer
    acc = [dict(fwd=2.0 * spec.seq_len * width, ns=0, big=0, muon=0, others=0, window=0)
           for _ in blocks]
    ends = [dict(fwd=0.0, ns=0, big=0, muon=0, others=0, window=0) for _ in range(2)]
    ep = spec.layout.ep if isinstance(spec.layout.ep, int) else 1
    for name, p in model.named_parameters():
        block = index.get(".".join(name.split(".")[:depth]))
        into = acc[block] if block is not None else ends[
            0 if any(name.startswith(e + ".") for e in embeds) else 1]
        expert = is_expert(name, p)
        n = p.numel()
        if p.ndim >= 2 and not (block is None and into is ends[0]):
            into["fwd"] += 2.0 * n * (top_k / p.shape[0] if expert and top_k else 1)
        if split.predicate(name):
            into["muon"] += n
            into["window"] += n // ep if expert else n
            into["ns"] += ns_flops(tuple(p.shape), o.ns_steps, o.ns_backend)
            into["big"] = max(into["big"], ns_flops(tuple(p.shape[-2:]), o.ns_steps,
                                                    o.ns_backend))
        else:
            into["others"] += n
    unit = lambda a: Unit(a["fwd"], a["ns"], a["big"], a["muon"], a["others"], a["window"])  # noqa: E731
    return unit(ends[0]), [unit(a) for a in acc], unit(ends[1])


def _hidden(model) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "hidden_size", None) or getattr(config, "dim", 0) or 0)


@dataclasses.dataclass
class PipelinePlan:
    layout: Layout
    stages: list[dict]  # per stage: its pp rank, layers [lo, hi), embedding, head, seconds
    ranks: list[dict]  # per pp rank: its ranks, stages, seconds, NS load, memory, pp bytes
    bubble: float
    by_count: dict  # the split by layer count alone, costed the same way
    without_ns: dict  # the split that leaves the optimizer step out, costed with it
    slowest_s: float
    modes: object = None  # ModeChoice on the worst pp rank

    def to_dict(self) -> dict:
        return {"schedule": self.layout.pp_schedule, "pp": self.layout.pp,
                "stages_per_rank": self.layout.pp_stages_per_rank,
                "micro_batches": self.layout.micro_batches, "bubble": self.bubble,
                "flops_per_gpu": Costs.__init__.__kwdefaults__["flops"],
                "slowest_s": self.slowest_s, "stages": self.stages, "ranks": self.ranks,
                "by_count": self.by_count, "without_ns": self.without_ns}


def _activations(spec: JobSpec, lay: Layout, flight: int, layers: int,
                 dims: tuple[int, int], head: bool, logits_split: int) -> int:
    """The micro-batch in backward counted as ``predict.choose_mode`` counts a rank's
    (its layers' activations, one recomputed block under checkpointing, and on the head's
    rank the logits, 1/``logits_split`` of them: the stages keep the whole model's TP
    plan, loss parallel included), so that pp 1 reads as ``predict``; the other
    ``flight`` - 1 micro-batches in flight their layers' activations (under
    checkpointing their blocks' inputs alone: only the micro-batch in backward
    recomputes a block), the logits of one micro-batch at a time."""
    micro = dict(tokens=lay.rows_per_micro * spec.seq_len, hidden=dims[0],
                 elt=DTYPES[spec.precision.compute].itemsize,
                 checkpointed=spec.activation_checkpointing != "none", tp=lay.tp)
    backward = activation_bytes(layers=layers, vocab=dims[1] if head else 0,
                                logits_split=logits_split, **micro)
    waiting = activation_bytes(layers=layers, vocab=0, **micro)
    if micro["checkpointed"]:  # their blocks' inputs: one block is recomputed at a time
        waiting -= activation_bytes(layers=0, vocab=0, **micro)
    return backward + (flight - 1) * waiting


def _memory(spec: JobSpec, lay: Layout, units: list[Unit], flight: int, layers: int,
            dims: tuple[int, int], head: bool, z3: bool,
            logits_split: int = 1) -> dict[str, int]:
    """One GPU's bytes by kind on a pp rank holding ``units`` (``layers`` of them per
    stage-chunk in flight, ``flight`` chunks); ``dims``: (hidden, vocabulary)."""
    p = spec.precision
    elt, master = DTYPES[p.compute].itemsize, DTYPES[p.master_dtype].itemsize
    R, N, T = lay.replicate, lay.shard, lay.tp
    E, A = sum(u.muon for u in units) / T, sum(u.others for u in units) / T
    windows = [u.window for u in units]
    z3_window = max((a + b for a, b in zip(windows, windows[1:] + [0])), default=0)
    act = _activations(spec, lay, flight, layers, dims, head, logits_split)
    return {k: int(v) for k, v in {
        "owned_params": E * elt / N + (E * master / (R * N) if master != elt else 0),
        "momentum": E * master / (R * N), "gradients": E * master / (R * N) + A * master / N,
        "fsdp_shards": A * master / N, "adamw_state": 2 * A * master / N,
        "packed_buffers": (z3_window if z3 else sum(windows)) / T * elt,
        "gathered_others": A * elt, "activations": act}.items()}


def _crosses_hosts(lay: Layout, a: int, b: int) -> bool:
    """Whether pp ranks ``a`` and ``b``'s peers (the same (r, s, t)) sit on two hosts."""
    S, W = lay.stage_ranks, lay.workers_per_node
    return any((a * S + j) // W != (b * S + j) // W for j in range(S))


def split_summary(costs: Costs, split: list[tuple[int, int]], pp: int) -> dict:
    return {"layers": [list(s) for s in split], "slowest_s": slowest(costs, split, pp),
            "stage_s": [costs(*s) for s in split]}


def pipeline_plan(spec: JobSpec, lay: Layout, units: tuple[Unit, list[Unit], Unit],
                  dims: tuple[int, int], device_bytes: int, params: int,
                  logits_split: int = 1) -> PipelinePlan:
    """The stage split and every pp rank's prediction on ``lay`` (pp > 1, batch split)."""
    embed, layers, head = units
    pp, v, m = lay.pp, lay.pp_stages_per_rank, lay.micro_batches
    common = dict(tokens=m * lay.rows_per_micro * spec.seq_len, owners=lay.dp_size,
                  tp=lay.tp, checkpointed=spec.activation_checkpointing != "none")
    costs = Costs(embed, layers, head, **common)
    n_stages = pp * v
    if n_stages > len(layers):
        raise SpecError(f"layout.pp: {pp} x {v} stages for the model's {len(layers)} layers: "
                        "a stage holds one layer at least")
    split = best_split(costs, n_stages)
    no_ns = best_split(Costs(embed, layers, head, with_ns=False, **common), n_stages)
    elt = DTYPES[spec.precision.compute].itemsize
    boundary = m * lay.rows_per_micro * spec.seq_len * dims[0] * elt // lay.tp
    stages = [{"stage": i, "pp_rank": i % pp, "layers": [lo, hi], "embedding": lo == 0,
               "head": hi == len(layers), "fwd_bwd_s": costs.fwd_bwd(lo, hi),
               "ns_flops_per_owner": costs.ns_at_owner(lo, hi), "ns_s": costs.ns(lo, hi),
               "seconds": costs(lo, hi),
               "link_next": None if i + 1 == n_stages else
               "infiniband" if _crosses_hosts(lay, i % pp, (i + 1) % pp) else "nvlink"}
              for i, (lo, hi) in enumerate(split)]
    ranks, peaks = [], {False: 0, True: 0}
    for k in range(pp):
        mine = [s for s in stages if s["pp_rank"] == k]
        held = [u for s in mine for u in layers[s["layers"][0]:s["layers"][1]]]
        held += [embed] if mine[0]["embedding"] else []
        held += [head] if mine[-1]["head"] else []
        flight = in_flight(lay.pp_schedule, pp, m, k, v)
        chunk = max(s["layers"][1] - s["layers"][0] for s in mine)
        memory = {z3: _memory(spec, lay, held, flight, chunk, dims, mine[-1]["head"], z3,
                              logits_split) for z3 in (False, True)}
        for z3 in memory:
            peaks[z3] = max(peaks[z3], sum(memory[z3].values()))
        links = [s["link_next"] for s in mine if s["link_next"]]
        ranks.append({
            "pp_rank": k, "ranks": [k * lay.stage_ranks, (k + 1) * lay.stage_ranks - 1],
            "stages": [s["stage"] for s in mine], "in_flight": flight,
            "seconds": sum(s["seconds"] for s in mine),
            "ns_flops_per_owner": sum(s["ns_flops_per_owner"] for s in mine),
            "memory_z2": memory[False], "memory_z3": memory[True],
            "pp_bytes": {"forward": boundary * sum(1 for s in mine if not s["head"]),
                         "backward": boundary * sum(1 for s in mine if not s["embedding"])},
            "links": sorted(set(links))})
    modes = decide(spec.dmuon, params=params, gpus=lay.world_size, shard=lay.shard,
                   device_bytes=device_bytes, z2_bytes=peaks[False], z3_bytes=peaks[True],
                   resident_pm=max(r["memory_z2"]["packed_buffers"] for r in ranks),
                   device="GPU" if spec.resources_per_worker.GPU else "CPU")
    z3 = modes.dmuon == "z3"
    for r in ranks:
        both = {False: r.pop("memory_z2"), True: r.pop("memory_z3")}
        r["peak_z2_bytes"], r["peak_z3_bytes"] = (sum(both[z].values()) for z in (False, True))
        r["memory"] = both[z3]
        r["peak_bytes"] = sum(r["memory"].values())
        r["fits"] = r["peak_bytes"] <= HEADROOM * device_bytes
    return PipelinePlan(lay, stages, ranks, bubble(lay.pp_schedule, pp, m, v),
                        split_summary(costs, count_split(len(layers), n_stages), pp),
                        split_summary(costs, no_ns, pp), slowest(costs, split, pp), modes)


def runnable(lay: Layout, model, source, seq_len: int) -> None:
    """Refuse, naming the field, a pipeline the workers cannot run: ``pp`` x v stages
    that do not divide the decoder layers (or a model with no split), TP inside the
    stages over a sequence it does not cut evenly (the stages' static shapes hold
    1/tp of it), weights to load into expert-parallel shards."""
    from ..layout import PlacementError
    from ..models.stages import check_pp_degree

    try:
        check_pp_degree(model, lay.pp * lay.pp_stages_per_rank, lay.pp)
    except ValueError as e:
        raise PlacementError(str(e), "layout.pp") from None
    if seq_len % lay.tp:
        raise PlacementError(f"seq_len = {seq_len} with layout.tp = {lay.tp} and layout.pp "
                             f"= {lay.pp}: the stages pass 1/tp of the sequence each, so "
                             "tp must divide seq_len", "seq_len")
    if source is not None and getattr(source, "weights", None) and lay.ep_enabled:
        raise PlacementError(f"model.weights with layout.pp = {lay.pp} x ep = {lay.ep}: "
                             "loading weights into expert-parallel shards is not supported "
                             "yet; set layout.ep: 1", "model.weights")


def pipeline_placement(spec: JobSpec, nodes, meta, pp: int | None = None, *,
                       projection: bool = False):
    """(the layout, its ``PipelinePlan``) on ``nodes``: pp the spec's, or ``pp``;
    ``projection``: a layout weighed for a record, not one workers will run (no
    ``runnable`` check: uneven splits)."""
    from .layout_choice import choose_layout
    from .predict import _embedding, checked_tp_view, device_bytes

    lay = choose_layout(nodes, spec, pp=pp)
    prepared = meta.prepared()
    model = prepared.model
    if lay.pp_enabled and not projection:
        runnable(lay, model, meta.source, spec.seq_len)
    embed = _embedding(model)
    dims = (_hidden(model) or (embed.embedding_dim if embed else 0),
            embed.num_embeddings if embed else 0)
    units = model_units(model, prepared.split, prepared.blocks, spec)
    params = sum(p.numel() for p in model.parameters())
    plan = pipeline_plan(spec, lay, units, dims,
                         device_bytes(spec, nodes, lay.workers_per_node), params,
                         checked_tp_view(model, lay.tp, prepared.blocks, *dims).logits_split)
    return lay, plan


def choose_pp(spec: JobSpec, nodes, meta):
    """``layout.pp: auto``: the smallest pp > 1 (dividing the workers over T, at most the
    layers) with which the worst pp rank fits; where none does, the one needing least.
    (pp 1 is weighed by the caller, on the planner's usual path.)"""
    from .layout_choice import PlacementError, nodes_and_workers, spec_tp

    n, per_node = nodes_and_workers(nodes, spec)
    groups = n * per_node // (spec_tp(spec) or 1)
    best = None
    for pp in (d for d in range(2, groups + 1) if groups % d == 0):
        try:
            lay, plan = pipeline_placement(spec, nodes, meta, pp)
        except (PlacementError, SpecError):
            continue
        if plan.modes.fits:
            return lay, plan
        need = max(r["peak_bytes"] for r in plan.ranks)
        if best is None or need < best[0]:
            best = (need, lay, plan)
    if best is None:
        raise SpecError("layout.pp: auto: no pipeline degree splits this model on these "
                        "workers")
    return best[1], best[2]

