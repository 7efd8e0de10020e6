"""The plan of an elastic job (``layout.elastic``): for every node count of its range the
layout it runs (one replica per node, shard within it, as a fixed job's, and the same
tensor-parallel degree T on every count: R varies, N x T is the node), how its ranks
split the fixed global batch, the per-rank predictions and the partition, or why that
count cannot run (a batch that does not split, a rank over its memory). Ray Train gets
the runnable range; the largest runnable count is the plan's own layout. ``tp: auto``
takes the smallest T whose range runs."""

from __future__ import annotations

from ..models.source import ModelSource
from ..plan_document import ElasticLayout, Inventory, PlanDocument
from ..spec import JobSpec, SpecError
from .inventory import NodeInfo
from .layout_choice import (
    PlacementError,
    layout_of,
    nodes_and_workers,
    scaling_kwargs,
    search_tp,
    spec_tp,
)
from .modes import GB, HEADROOM
from .predict import needed_bytes, predict


def _size(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1e6:.2f} MB"


def _entry(spec: JobSpec, node: NodeInfo, n: int, per_node: int, T: int,
           model_source: ModelSource | None | bool) -> tuple[ElasticLayout, dict | None]:
    """(node count ``n``'s entry, the Muon/AdamW split it predicted with)."""
    try:
        layout = layout_of(spec, n, per_node, n, per_node // T, T)
    except PlacementError as e:  # the global batch does not split on this count
        if e.field != "global_batch_tokens":
            raise
        layout = layout_of(spec, n, per_node, n, per_node // T, T, batch=False)
        return ElasticLayout(layout=layout, refused=str(e)), None
    if model_source is False:  # deferred: the job's driver predicts it
        return ElasticLayout(layout=layout), None
    placement = predict(spec, [node] * n, model_source=model_source, layout=layout)
    layout = placement.layout  # with the EP degree the partition was made for
    modes, refused = placement.modes, None
    if not modes.fits:
        held = needed_bytes(modes)
        refused = (f"a rank would hold {_size(held)} in {modes.dmuon.upper()}, over the "
                   f"{_size(HEADROOM * modes.device_bytes)} usable of its "
                   f"{_size(modes.device_bytes)}")
    return ElasticLayout(layout=layout, modes=modes.to_dict(), ranks=placement.ranks,
                         refused=refused, partition=placement.plan.to_dict()), placement.split


def elastic_document(spec: JobSpec, node: NodeInfo, inventory: dict,
                     model_source: ModelSource | None | bool = None) -> PlanDocument:
    """The plan of every node count in ``spec.layout.elastic`` on nodes shaped like
    ``node`` (``model_source=False``: layouts and batch splits alone, for a model only
    the job can build). Refuses a range with no runnable count, naming each one's reason,
    and one with a count that cannot run between two that can. ``tp: auto``: the
    smallest T (dividing the node's workers) whose range runs."""
    _, per_node = nodes_and_workers([node], spec)
    T = spec_tp(spec)
    if T is not None:
        return _range_document(spec, node, inventory, model_source, per_node, T)
    if model_source is False:
        raise SpecError("layout.tp: auto chooses T on the model, which the job alone can "
                        "build; give layout.tp a number")
    made, tried, _ = search_tp(per_node, lambda T: (_range_document(
        spec, node, inventory, model_source, per_node, T), None),
        refused=(SpecError, PlacementError))
    if made is None:
        raise SpecError("layout.tp: auto: no tensor-parallel degree runs the range: "
                        + "; ".join(f"T={T}: {why.removeprefix('layout.')}" for T, why in tried))
    return made


def _range_document(spec: JobSpec, node: NodeInfo, inventory: dict, model_source,
                    per_node: int, T: int) -> PlanDocument:
    if per_node % T:
        raise SpecError(f"layout.tp={T} must divide the {per_node} workers per node: a "
                        "tensor-parallel group never spans nodes")
    rng = spec.layout.elastic
    made = [_entry(spec, node, n, per_node, T, model_source)
            for n in range(rng.min_nodes, rng.max_nodes + 1)]
    runnable = [(e, split) for e, split in made if e.refused is None]
    if not runnable:
        raise SpecError("layout.elastic: no node count in the range can run: " + "; ".join(
            f"{e.layout.nodes} node(s): {e.refused}" for e, _ in made))
    counts = [e.layout.nodes for e, _ in runnable]
    inside = [e for e, _ in made if e.refused and counts[0] < e.layout.nodes < counts[-1]]
    if inside:  # Ray Train may start any count of its range: each one must run
        raise SpecError(
            f"layout.elastic: {', '.join(str(e.layout.nodes) for e in inside)} node(s) "
            f"lie between runnable counts {counts[0]} and {counts[-1]} but cannot run "
            f"({inside[0].refused}); narrow the range or change global_batch_tokens")
    top, split = runnable[-1]
    scaling = scaling_kwargs(spec, top.layout)
    scaling.update(min_workers=runnable[0][0].layout.world_size,
                   elastic_resize_monitor_interval_s=rng.resize_check_s)
    return PlanDocument(layout=top.layout, inventory=Inventory(**inventory), scaling=scaling,
                        modes=top.modes, optimizer_split=split, ranks=top.ranks,
                        partition=top.partition, elastic=[e for e, _ in made])
