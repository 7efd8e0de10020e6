"""Jobs: submit (planned once, stored with the job), register one started with ``ray job
submit``, list, read, cancel, partition, and a plan without a job."""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Annotated, Literal

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from service.job.inputs import inputs_json, resolve_inputs, resolve_model
from service.job.inputs.working_dir import PackageError, runtime_working_dir
from service.job.job_dir import EXPORT, INPUTS
from service.job.models.params import ParamRuleError
from service.job.plan.layout_choice import PlacementError
from service.job.plan.make import plan_document
from service.job.plan_document import PlanDocument, stored_layout
from service.job.spec import JobSpec, SpecError, named_field, text

from ..auth import JOB_ID, JobId, guarded, token_hash
from ..sql_tables import STATES

SPEC_BYTES = 64 << 10  # a spec is a few hundred bytes; this leaves room for comments
PLAN_BYTES = 64 << 20  # a plan lists every Muon param with its owner: 70B's is ~1 MB
# a dry run is stored as SUCCEEDED (it ended: planned, nothing to run) with dry_run true
DRY_RUN_MESSAGE = "dry run: planned and stored, never run on Ray"
admin = APIRouter(route_class=guarded("admin"), tags=["jobs"])
reads = APIRouter(route_class=guarded("read"), tags=["jobs"])
job_posts = APIRouter(route_class=guarded("job"), tags=["jobs"])


class JobSubmission(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    spec: JobSpec
    dry_run: bool = False


class Registration(BaseModel):
    """A job started with ``ray job submit``, as its entrypoint registers it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    spec: JobSpec
    submission_id: str = Field(pattern=JOB_ID, description="the job's Ray submission id")


def _job_or_404(store, job_id: str, with_plan: bool = False) -> dict:
    """The job as the API shows it (its history, no plan), or with its stored plan."""
    job = store.get_job(job_id) if with_plan else store.job_view(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return job


def _model_source(request: Request, spec: JobSpec) -> dict:
    try:
        return resolve_model(spec, request.app.state.settings.data_dir())[0]
    except SpecError as e:
        raise HTTPException(422, [{"field": _field_of(e), "message": str(e)}]) from None


def _field_of(error: Exception) -> str:
    """``spec.<field>``: the field a placement refuses, else the one a message names at
    its head (``layout.tp = 3 does not divide ...``), else the spec as a whole."""
    named = getattr(error, "field", None) or named_field(str(error))
    return f"spec.{named}" if named else "spec"


def _plan(request: Request, spec: JobSpec, model_source: dict) -> PlanDocument:
    """The plan that will run, on the attached cluster's nodes when it fits them now;
    at most ``max_concurrent_plans`` at a time (each builds a model on the meta device)."""
    state = request.app.state
    if not state.plans.acquire(timeout=30):
        raise HTTPException(429, "too many plans at once; retry", headers={"Retry-After": "2"})
    try:
        cluster = state.runner.inventory() if state.runner is not None else None
        return plan_document(spec, cluster, state.settings.local_cpus, model_source)
    except (PlacementError, ParamRuleError, SpecError) as e:
        raise HTTPException(422, [{"field": _field_of(e), "message": str(e)}]) from None
    finally:
        state.plans.release()


@admin.post("/v1/plan", max_body_size=SPEC_BYTES)
def plan(spec: JobSpec, request: Request):
    """The layout and per-rank predictions for a spec, without a job."""
    planned = _plan(request, spec, _model_source(request, spec))
    return JSONResponse(planned.model_dump(mode="json"))


@admin.post("/v1/jobs", status_code=201, max_body_size=SPEC_BYTES)
def submit(body: JobSubmission, request: Request, response: Response,
           idempotency_key: Annotated[text(256) | None, Header()] = None):
    """A new job (201), or with a repeated ``Idempotency-Key`` the job that key made
    (200); 409 if that key came with another request."""
    state = request.app.state
    inputs = None
    if body.dry_run:
        model_source = _model_source(request, body.spec)
    else:  # every path and size, before anything is stored; the driver runs on them
        try:
            inputs = resolve_inputs(body.spec, state.settings.data_dir(),
                                    state.settings.storage)
            if body.spec.working_dir is not None:
                runtime_working_dir(state.settings.storage, body.spec.working_dir)
        except (SpecError, PackageError) as e:
            raise HTTPException(422, [{"field": _field_of(e), "message": str(e)}]) from None
        model_source = inputs["model"]
    planned = _plan(request, body.spec, model_source)
    spec = body.spec.model_dump(mode="json")
    job, created = state.store.create_job(
        body.spec.name, spec, dry_run=body.dry_run, plan=planned.model_dump(mode="json"),
        idempotency_key=idempotency_key, status="SUCCEEDED" if body.dry_run else "PENDING",
        message=DRY_RUN_MESSAGE if body.dry_run else None)
    if (job["spec"], job["dry_run"]) != (spec, body.dry_run):
        raise HTTPException(409, f"Idempotency-Key {idempotency_key!r} was used for "
                                 f"another request (job {job['id']})")
    response.status_code = 201 if created else 200
    if created and inputs is not None:
        _keep_inputs(state.settings.storage, job["id"], inputs)
    job.pop("plan")
    return job


def _keep_inputs(storage: str, job_id: str, inputs: dict) -> None:
    """The inputs resolved here, in the job's directory beside its spec and plan: the
    driver runs on them, so a submission resolves its inputs once."""
    job_dir = os.path.join(storage, job_id)
    os.makedirs(job_dir, exist_ok=True)
    with open(os.path.join(job_dir, INPUTS), "w") as fh:
        fh.write(inputs_json(inputs))


@admin.post("/v1/jobs/register", status_code=201, max_body_size=SPEC_BYTES)
def register(body: Registration, request: Request):
    """A job its entrypoint runs under ``ray job submit`` on this service's cluster:
    planned here, stored RUNNING under its submission id and followed like any other job
    (status, metrics, logs, cancel). Answers the job, the plan it is to run and its own
    token for its metric posts; 409 if the id is taken."""
    state, job_id = request.app.state, body.submission_id
    if state.store.job_status(job_id) is not None:  # before planning; the insert checks too
        raise HTTPException(409, f"job {job_id!r} exists; a job registers once")
    _check_on_ray(state.runner, job_id)
    planned = _plan(request, body.spec, _model_source(request, body.spec))
    plan = planned.model_dump(mode="json")
    token = secrets.token_urlsafe(32)
    job = state.store.register_job(job_id, body.spec.name, body.spec.model_dump(mode="json"),
                                   plan, token_hash(token))
    if job is None:  # registered meanwhile
        raise HTTPException(409, f"job {job_id!r} exists; a job registers once")
    job.pop("plan")
    return {"job": job, "plan": plan, "job_token": token}


def _check_on_ray(runner, submission_id: str) -> None:
    """422 naming ``submission_id`` unless the attached cluster runs that Ray job."""
    where = None if runner is None else runner.ray_address
    try:
        known = runner is not None and runner.has_job(submission_id)
    except Exception as e:  # noqa: BLE001 - Ray's client raises several kinds
        raise HTTPException(503, f"cannot ask Ray at {where} about {submission_id!r}: "
                                 f"{e}", headers={"Retry-After": "5"}) from None
    if not known:
        why = (f"Ray at {where} has no job {submission_id!r}" if runner is not None
               else "this service has no Ray cluster attached")
        raise HTTPException(422, [{"field": "submission_id", "message":
                                   f"{why}: only a job on the cluster this service runs "
                                   f"on can be registered (it follows the job there)"}])


@admin.post("/v1/jobs/{job_id}/cancel")
def cancel(job_id: JobId, request: Request):
    """A queued or running job becomes STOPPED (an ended job stays as it was)."""
    state = request.app.state
    job, on_ray = state.store.cancel(job_id)
    if job is None:
        raise HTTPException(404, f"no job {job_id!r}")
    if on_ray and state.runner is not None:
        state.runner.stop_quietly(job_id)  # the runner retries until Ray agrees
    job.pop("plan")
    return job


@reads.get("/v1/jobs")
def jobs(request: Request, status: Literal[STATES] | None = None,
         limit: int = Query(100, ge=1, le=10_000)):
    return JSONResponse(request.app.state.store.list_jobs(status, limit))


@reads.get("/v1/jobs/{job_id}")
async def job(job_id: JobId, request: Request):
    """A job with its status history. Two indexed reads, run on the event loop: the
    thread pool's hand-off would cost more than the reads (dashboards poll this)."""
    return JSONResponse(_job_or_404(request.app.state.store, job_id))


@reads.get("/v1/jobs/{job_id}/partition")
def partition(job_id: JobId, request: Request):
    """The stored plan: owner per parameter, per-rank predictions, layout, inventory,
    and a pipeline's stage split (``pipeline``, null without PP)."""
    planned = _job_or_404(request.app.state.store, job_id, with_plan=True)["plan"]
    shown = ("inventory", "modes", "optimizer_split", "deferred", "completed_by", "pipeline")
    return JSONResponse({"layout": planned["layout"], **{k: planned.get(k) for k in shown},
                         "ranks": planned["ranks"], **(planned.get("partition") or {}),
                         "elastic": _elastic_table(planned.get("elastic"))})


def _elastic_table(entries: list[dict] | None) -> list[dict] | None:
    """An elastic plan's node counts as the dashboard shows them: each one's layout, batch
    split, mode and per-rank memory (the partitions stay in the stored plan)."""
    if entries is None:
        return None
    kept = ("layout", "micro_batches", "rows_per_micro", "modes", "refused")
    return [{**{k: e.get(k) for k in kept}, "memory": [r["memory"] for r in e["ranks"]]}
            for e in entries]


@job_posts.put("/v1/jobs/{job_id}/plan", max_body_size=PLAN_BYTES)
def complete_plan(job_id: JobId, plan: PlanDocument, request: Request):
    """The plan a job's entrypoint completed for a model the control plane could not
    build (the job's own token): accepted once, in place of the deferred plan, on the
    layout that plan stored."""
    store = request.app.state.store
    stored = _job_or_404(store, job_id, with_plan=True)["plan"]
    if stored is None or stored.get("partition") is not None:
        raise HTTPException(409, f"job {job_id} has a complete plan; it is not replaced")
    # a deferred plan stored before tensor parallelism has no layout.tp (its default),
    # one stored before the layout carried the batch split has none to compare
    was = stored_layout(stored["layout"])
    done = plan.layout if was.micro_batches is not None else plan.layout.replace(
        micro_batches=None, rows_per_micro=None)
    if not plan.complete or done != was:
        raise HTTPException(422, [{"field": "layout", "message":
                                   f"a completed plan on the stored layout {stored['layout']} "
                                   f"is expected, got {dataclasses.asdict(plan.layout)}"
                                   f"{'' if plan.complete else ' without a partition'}"}])
    if not store.complete_plan(job_id, stored, plan.model_dump(mode="json")):
        raise HTTPException(409, f"job {job_id}'s plan changed meanwhile")
    return {"stored": True}


@admin.post("/v1/jobs/{job_id}/export", status_code=202)
def export(job_id: JobId, request: Request):
    """Export a job's newest checkpoint to ``<storage>/<job>/export`` (sharded safetensors
    + config.json) by a Ray job of its own; answers its submission id."""
    state = request.app.state
    job = _job_or_404(state.store, job_id, with_plan=True)  # the export runs on its plan
    if job["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
        raise HTTPException(409, f"job {job_id} is {job['status']}: export it once it ended")
    if state.runner is None:
        raise HTTPException(503, "no Ray cluster attached")
    try:
        return {"submission_id": state.runner.submit_export(job),
                "path": os.path.join(state.settings.storage, job_id, EXPORT)}
    except PackageError as e:
        raise HTTPException(422, [{"field": "spec.working_dir", "message": str(e)}]) from None


@reads.get("/v1/jobs/{job_id}/export")
def exported(job_id: JobId, request: Request, submission_id: str | None = None):
    """The export directory's files (empty until written), and an export job's status."""
    state = request.app.state
    _job_or_404(state.store, job_id)
    path = os.path.join(state.settings.storage, job_id, EXPORT)
    files = sorted(os.listdir(path)) if os.path.isdir(path) else []
    status = None
    if submission_id is not None and state.runner is not None:
        if not submission_id.startswith(f"{job_id}-export-"):
            raise HTTPException(404, f"no export {submission_id!r} of job {job_id}")
        status = state.runner.status_of(submission_id)
    return {"path": path, "files": files, "status": status}
