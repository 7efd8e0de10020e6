"""One job as its workers run it: the spec, the stored plan, the resolved inputs and
where its files go. The driver makes it once from the plan document it stored and hands
it to every worker unchanged (Ray Train pickles it into each worker's config), so no
worker parses the spec or the plan again; ``Job.local`` makes one for tests and
benchmarks. The tracking sinks are the spec's (``spec.tracking``): the driver's
controller callback writes them, not the workers."""

from __future__ import annotations

import dataclasses
import os

from .job_dir import CHECKPOINTS, EXPORT
from .plan_document import PlanDocument
from .spec import JobSpec, parse_spec


@dataclasses.dataclass(frozen=True)
class Job:
    spec: JobSpec
    plan: PlanDocument | None = None  # the stored plan; None: planned by nothing (tests)
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
    def local(cls, spec: JobSpec | dict, **fields) -> Job:
        """A job outside the service (a spec, or its JSON form), for tests and benchmarks."""
        return cls(spec if isinstance(spec, JobSpec) else parse_spec(spec), **fields)
