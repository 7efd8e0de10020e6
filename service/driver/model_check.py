"""The driver's check of a stored plan against the model its workers will build, before
any worker starts (the control plane plans; only the driver imports the job's model code
for certain)."""

from __future__ import annotations

from service.job.models.source import ModelSource
from service.job.plan_document import PlanDocument
from service.job.spec import JobSpec


def check_against_model(spec: JobSpec, plan: PlanDocument, source: ModelSource) -> None:
    """Refuse (``dmuon.PlanMismatch``, naming the first param that differs) a complete plan
    whose partition does not describe the model the workers will build: where the job
    starts, before any worker does (each worker's ``dedicate_params`` checks it again)."""
    from dmuon.planning import DedicationPlan, check_plan, model_entries
    from service.job.models.build import prepare_on_meta
    from service.job.models.dtypes import DTYPES
    from service.job.models.experts import is_expert

    prepared = prepare_on_meta(spec, source, DTYPES[spec.precision.master_dtype])
    model, split = prepared.model, prepared.split
    entries = model_entries(model, split.predicate, split.boundary_predicate(model))
    ep_size = plan.partition.get("ep_size", 1)
    experts = [n for n, p in model.named_parameters()
               if ep_size > 1 and split.predicate(n) and is_expert(n, p)]
    check_plan(DedicationPlan.from_dict(plan.partition), entries, plan.layout.shard,
               plan.layout.replicate, ep_params=experts, ep_size=ep_size)
