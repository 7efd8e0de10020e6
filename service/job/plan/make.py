"""The plan document of a submission, made once: the layout on the attached cluster (or
on assumed nodes, with the reason), the predictions, and the partition; or, for a model
only the job's own processes can import, the layout alone (deferred: the job's
entrypoint completes it, once, before any worker starts)."""

from __future__ import annotations

import threading

from ..layout import Layout
from ..plan_document import Inventory, PlanDocument
from ..spec import JobSpec, SpecError
from .elastic import elastic_document
from .inventory import NodeInfo, synthetic_inventory
from .layout_choice import (
    PlacementError,
    batch_split,
    choose_layout,
    scaling_kwargs,
    slots,
    spec_tp,
)
from .pipeline_plan import choose_pp, pipeline_placement
from .predict import MetaModel, Placement, predict


def plan_document(spec: JobSpec, cluster: list[NodeInfo] | None, assumed_cpus: int,
                  model_source: dict | None = None) -> PlanDocument:
    """``_plan_document`` for this spec and cluster, computed once: submissions come in
    bursts of the same spec (retries, sweeps), and a plan builds a model."""
    key = (spec.model_dump_json(), "mode" in spec.dmuon.model_fields_set,  # its reason
           repr(cluster), assumed_cpus,
           model_source.model_dump_json() if model_source is not None else None)
    with _PLANS_LOCK:
        cached = _PLANS.get(key)
    if cached is None:
        cached = _plan_document(spec, cluster, assumed_cpus, model_source).model_dump_json()
        with _PLANS_LOCK:
            _PLANS[key] = cached
            while len(_PLANS) > 64:
                _PLANS.pop(next(iter(_PLANS)))
    return PlanDocument.model_validate_json(cached)


_PLANS: dict[tuple, str] = {}
_PLANS_LOCK = threading.Lock()


def _plan_document(spec: JobSpec, cluster: list[NodeInfo] | None, assumed_cpus: int,
                   model_source: dict | None = None) -> PlanDocument:
    """The plan as stored with a job and run by its entrypoint: layout, per-rank
    predictions, the partition, and the nodes it was planned on. Those are the attached
    cluster's when the job fits them now; else (no cluster, or one that must grow first)
    ``layout.nodes`` assumed nodes of ``assumed_cpus`` CPUs, with the reason. The model
    is built on the meta device once, whatever layouts the plan weighs."""
    model_source = MetaModel.of(spec, model_source)
    if spec.layout.elastic is not None:
        return elastic_plan(spec, cluster, assumed_cpus, model_source)
    nodes, inventory = _nodes(spec, cluster, assumed_cpus)
    if spec.layout.pp != 1:
        planned = pipeline_document(spec, nodes, inventory, model_source)
        if planned is not None:
            return planned
    layout = choose_layout(nodes, spec)
    try:  # tp: auto chooses T on the same nodes
        placement = predict(spec, nodes, model_source=model_source,
                            layout=layout if spec_tp(spec) else None)
    except ImportError as e:  # a factory importable only from the job's working_dir
        if spec_tp(spec) is None:
            raise SpecError(f"layout.tp: auto chooses T on the model, which cannot be "
                            f"built here ({type(e).__name__}: {e}); give layout.tp a "
                            "number") from None
        return deferred_document(spec, layout, inventory, f"{type(e).__name__}: {e}")
    return placement_document(placement, inventory)


def _nodes(spec: JobSpec, cluster: list[NodeInfo] | None, assumed_cpus: int):
    """(the nodes planned on, the inventory saying which): the attached cluster's when
    the job fits them now, else ``layout.nodes`` assumed nodes, with the reason."""
    try:
        if not cluster:
            raise PlacementError("no Ray cluster attached" if cluster is None else
                                 "the Ray cluster lists no alive node")
        choose_layout(cluster, spec)
        return cluster, {"source": "cluster", "nodes": len(cluster)}
    except PlacementError as on_cluster:
        count = spec.layout.nodes if spec.layout.nodes != "auto" else 1
        return (synthetic_inventory(count, 0, cpus_per_node=assumed_cpus),
                {"source": "assumed", "nodes": count, "cpus_per_node": assumed_cpus,
                 "reason": str(on_cluster)})


def pipeline_document(spec: JobSpec, nodes: list[NodeInfo], inventory: dict,
                      meta: MetaModel) -> PlanDocument | None:
    """The plan of a pipeline-parallel layout: the stage split, each pp rank's ranks,
    stages, NS load, memory and pp bytes, the mode on the worst one. None for ``pp:
    auto`` where pp 1 fits (the usual plan then)."""
    if spec.layout.pp == "auto":
        try:
            flat = predict(spec, nodes, model_source=meta,
                           layout=choose_layout(nodes, spec, pp=1) if spec_tp(spec) else None)
            if flat.modes.fits:
                return None
        except (PlacementError, SpecError):
            pass
        layout, plan = choose_pp(spec, nodes, meta)
    else:
        layout, plan = pipeline_placement(spec, nodes, meta)
    return PlanDocument(layout=layout, inventory=Inventory(**inventory),
                        modes=plan.modes.to_dict(),
                        optimizer_split=meta.prepared().split.to_dict(),
                        scaling=scaling_kwargs(spec, layout), pipeline=plan.to_dict())


def elastic_plan(spec: JobSpec, cluster: list[NodeInfo] | None, assumed_cpus: int,
                  model_source) -> PlanDocument:
    """Every node count of the range, on nodes shaped like the cluster's smallest that
    fits a worker (else assumed ones): an elastic job runs on what the cluster holds."""
    model_source = MetaModel.of(spec, model_source)  # one build for the range
    usable = [n for n in cluster or [] if slots(n, spec) > 0]
    if usable:
        node = min(usable, key=lambda n: slots(n, spec))
        inventory = {"source": "cluster", "nodes": len(cluster)}
    else:
        node = synthetic_inventory(1, 0, cpus_per_node=assumed_cpus)[0]
        inventory = {"source": "assumed", "nodes": 1, "cpus_per_node": assumed_cpus,
                     "reason": "no Ray cluster attached" if cluster is None else
                     "no node of the Ray cluster fits a worker"}
    try:
        return elastic_document(spec, node, inventory, model_source)
    except ImportError as e:  # a factory importable only from the job's working_dir
        plan = elastic_document(spec, node, inventory, False)
        return plan.model_copy(update={"deferred": f"the model cannot be built here "
                                       f"({type(e).__name__}: {e}); the job plans it"})


def placement_document(placement: Placement, inventory: dict) -> PlanDocument:
    return PlanDocument(
        layout=placement.layout,
        inventory=Inventory(**inventory), modes=placement.modes.to_dict(),
        optimizer_split=placement.split, ranks=[r.__dict__ for r in placement.ranks],
        partition=placement.plan.to_dict(), scaling=placement.scaling_config_kwargs())


def deferred_document(spec: JobSpec, layout: Layout, inventory: dict,
                      reason: str) -> PlanDocument:
    """The layout alone, for a model only the job's own processes can import: the job's
    driver completes the plan (partition, mode) once, before any worker starts, and
    stores it with the job."""
    return PlanDocument(
        layout=layout, inventory=Inventory(**inventory),
        deferred=f"the model cannot be built here ({reason}); the job plans it",
        scaling=scaling_kwargs(spec, layout))


def with_batch_splits(spec: JobSpec, plan: PlanDocument) -> PlanDocument:
    """``plan`` with a batch split in every layout that can have one: a document stored
    before the layout carried it gets it here, from its spec, once, in the driver (the
    workers read it and compute nothing). ``plan`` itself when none lacks it."""
    def split(layout: Layout) -> Layout:
        try:
            micros, rows = batch_split(spec, layout.dp_size)
        except ValueError:  # an elastic count refused for it keeps its reason
            return layout
        return layout.replace(micro_batches=micros, rows_per_micro=rows)

    if plan.layout.micro_batches is not None and all(
            e.layout.micro_batches is not None or e.refused for e in plan.elastic or []):
        return plan
    elastic = None if plan.elastic is None else [
        e if e.layout.micro_batches is not None else e.model_copy(
            update={"layout": split(e.layout)}) for e in plan.elastic]
    return plan.model_copy(update={"layout": split(plan.layout), "elastic": elastic})


def plan_on_one_host(spec: JobSpec | dict, world_size: int | None = None,
                     source=None) -> PlanDocument:
    """The plan of ``spec`` for ``world_size`` workers (default: the process group's) on
    one synthetic host, as a submission's would be made (``source``: the resolved
    model, by default the spec's resolved here): for tests and benchmarks that run the
    workers' loop without the service."""
    import torch.distributed as dist

    from ..inputs import resolve_model
    from ..spec import parse_spec

    spec = spec if isinstance(spec, JobSpec) else parse_spec(spec)
    world = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
    host = synthetic_inventory(1, 0, cpus_per_node=int(world * spec.resources_per_worker.CPU))
    return plan_document(spec, host, world, source or resolve_model(spec, ".")[0])
