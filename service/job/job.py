"""One job as its workers run it: the spec, the stored plan, the resolved inputs and
where its files go. The driver makes it once from the plan document it stored and hands
it to every worker unchanged (Ray Train pickles it into each worker's config), so no
worker parses the spec or the plan again, nor plans: the stored plan (its ``Layout``, its
partition, its modes) is the workers' only input beside the spec. ``Job.local`` makes
one for tests and benchmarks on a plan the planner made. The tracking sinks are the
spec's (``spec.tracking``): the driver's controller callback writes them, not the
workers."""

from __future__ import annotations

import dataclasses
import os

from .job_dir import CHECKPOINTS, EXPORT
from .plan_document import PlanDocument
from .spec import JobSpec, parse_spec


@dataclasses.dataclass(frozen=True)
class Job:
    spec: JobSpec
    plan: PlanDocument  # the stored plan, as the driver checked it
    inputs: dict | None = None  # ``resolve_inputs``'s; None: the built-in model and corpus
    job_dir: str | None = None  # each rank's records and the layout events go here
    checkpoint_dir: str | None = None
    export_dir: str | None = None
    export_only: bool = False  # rewrite the export from the newest checkpoint, no step

    @classmethod
    def stored(cls, spec: JobSpec, plan: PlanDocument, inputs: dict | None, job_dir: str,
               export_only: bool = False) -> Job:
        """The job the driver runs from its stored plan, in its job directory."""
        return cls(spec, plan, inputs, None if export_only else job_dir,
                   os.path.join(job_dir, CHECKPOINTS), os.path.join(job_dir, EXPORT),
                   export_only)

    @classmethod
    def local(cls, spec: JobSpec | dict, plan: PlanDocument, **fields) -> Job:
        """A job outside the service (a spec, or its JSON form) on ``plan``, for tests and
        benchmarks (``service.job.plan.make.plan_on_one_host`` plans one as a submission
        would)."""
        return cls(spec if isinstance(spec, JobSpec) else parse_spec(spec), plan, **fields)
