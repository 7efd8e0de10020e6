"""The control plane: FastAPI over the job store, the planner and Ray's job API.

    uvicorn service.app:create_app --factory --host 127.0.0.1 --port 8000

Settings come from the environment: ``DMUON_API_TOKEN`` (bearer token for every
mutating endpoint and for logs), ``DMUON_DB`` (SQLite path), ``DMUON_STORAGE`` (job
directories), ``RAY_ADDRESS`` (Ray's dashboard address for the job API; unset: jobs
are only queued), ``DMUON_MAX_RUNNING``, ``DMUON_SERVICE_URL`` (where jobs post
metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from .planner import PlacementError, predict, synthetic_inventory
from .spec import JobSpec
from .store import TERMINAL, JobStore

VERSION = "0.1.0"


@dataclass
class Settings:
    api_token: str | None = field(default_factory=lambda: os.environ.get("DMUON_API_TOKEN"))
    db_path: str = field(default_factory=lambda: os.environ.get("DMUON_DB", "dmuon.db"))
    storage: str = field(default_factory=lambda: os.path.abspath(
        os.environ.get("DMUON_STORAGE", "dmuon_runs")))
    ray_address: str | None = field(default_factory=lambda: os.environ.get("RAY_ADDRESS"))
    max_running: int = field(default_factory=lambda: int(os.environ.get("DMUON_MAX_RUNNING",
                                                                        "1")))
    service_url: str = field(default_factory=lambda: os.environ.get(
        "DMUON_SERVICE_URL", "http://127.0.0.1:8000"))
    local_cpus: int = 4  # the inventory a plan assumes when no cluster is attached


class JobSubmission(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: JobSpec
    dry_run: bool = False


def _plan(spec: JobSpec, settings: Settings) -> dict:
    """The placement as JSON: layout, per-rank predictions and the partition."""
    nodes = spec.layout.nodes if spec.layout.nodes != "auto" else 1
    inventory = synthetic_inventory(nodes, 0, cpus_per_node=settings.local_cpus)
    if settings.ray_address:
        import ray

        if ray.is_initialized():
            from .planner import inventory_from_ray

            inventory = inventory_from_ray()
    placement = predict(spec, inventory)
    return {
        "layout": {"replicate": placement.replicate, "shard": placement.shard,
                   "nodes": placement.nodes},
        "ranks": [r.__dict__ for r in placement.ranks],
        "partition": placement.plan.to_dict(),
    }


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    store = JobStore(settings.db_path)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.ray_address:
            from .runner import RayJobRunner

            app.state.runner = RayJobRunner(store, settings.ray_address, settings.storage,
                                            settings.service_url, settings.max_running)
            app.state.runner.start()
        yield
        if app.state.runner is not None:
            app.state.runner.close()

    app = FastAPI(title="DMuon control plane", version=VERSION, lifespan=lifespan)
    app.state.store, app.state.settings, app.state.runner = store, settings, None

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        detail = [{"field": ".".join(str(p) for p in e["loc"] if p != "body"),
                   "message": e["msg"]} for e in exc.errors()]
        return JSONResponse({"detail": detail}, status_code=422)

    def require_token(authorization: str | None = Header(None)) -> None:
        expected = settings.api_token
        if expected is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token, expected):
            raise HTTPException(401, "missing or wrong bearer token",
                                headers={"WWW-Authenticate": "Bearer"})

    def job_or_404(job_id: str) -> dict:
        job = store.get_job(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job

    @app.get("/healthz")
    def healthz():
        return {"status": "ok"}

    @app.get("/version")
    def version():
        import torch

        return {"dmuon": VERSION, "torch": torch.__version__}

    @app.post("/v1/plan")
    def plan(spec: JobSpec):
        try:
            return _plan(spec, settings)
        except PlacementError as e:
            raise HTTPException(422, [{"field": "layout", "message": str(e)}]) from None

    @app.post("/v1/jobs", status_code=201, dependencies=[Depends(require_token)])
    def submit(body: JobSubmission, idempotency_key: str | None = Header(None)):
        try:
            planned = _plan(body.spec, settings)
        except PlacementError as e:
            raise HTTPException(422, [{"field": "spec.layout", "message": str(e)}]) from None
        return store.create_job(body.spec.name, body.spec.model_dump(mode="json"),
                                dry_run=body.dry_run, plan=planned,
                                idempotency_key=idempotency_key,
                                status="SUCCEEDED" if body.dry_run else "PENDING")

    @app.get("/v1/jobs")
    def jobs(status: str | None = None, limit: int = 100):
        return [{k: v for k, v in j.items() if k != "plan"}
                for j in store.list_jobs(status, limit)]

    @app.get("/v1/jobs/{job_id}")
    def job(job_id: str):
        found = job_or_404(job_id)
        found.pop("plan")
        return {**found, "history": store.history(job_id)}

    @app.post("/v1/jobs/{job_id}/cancel", dependencies=[Depends(require_token)])
    def cancel(job_id: str):
        found = job_or_404(job_id)
        if found["status"] == "RUNNING" and app.state.runner is not None:
            app.state.runner.stop(job_id)
        store.set_status(job_id, "STOPPED", "cancelled")
        return store.get_job(job_id)

    @app.get("/v1/jobs/{job_id}/partition")
    def partition(job_id: str):
        planned = job_or_404(job_id)["plan"]
        return {"layout": planned["layout"], "ranks": planned["ranks"],
                **planned["partition"]}

    @app.get("/v1/jobs/{job_id}/metrics")
    def metrics(job_id: str, after_step: int = 0):
        job_or_404(job_id)
        return store.metrics(job_id, after_step)

    @app.get("/v1/jobs/{job_id}/logs", dependencies=[Depends(require_token)])
    def logs(job_id: str):
        job_or_404(job_id)
        runner = app.state.runner
        return PlainTextResponse(runner.logs(job_id) if runner and not
                                 store.get_job(job_id)["dry_run"] else "")

    @app.get("/v1/jobs/{job_id}/events")
    async def events(job_id: str, poll_s: float = 0.5):
        job_or_404(job_id)

        async def stream():
            step, status = 0, None
            while True:
                for rec in store.metrics(job_id, step):
                    step = max(step, rec["step"])
                    yield f"event: metrics\ndata: {json.dumps(rec)}\n\n"
                current = store.get_job(job_id)["status"]
                if current != status:
                    status = current
                    yield f"event: status\ndata: {json.dumps({'status': status})}\n\n"
                if status in TERMINAL:
                    return
                await asyncio.sleep(poll_s)

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/metrics", dependencies=[Depends(require_token)])
    def ingest(records: list[dict]):
        bad = [i for i, r in enumerate(records) if not {"job_id", "step", "rank"} <= set(r)]
        if bad:
            raise HTTPException(422, [{"field": f"{i}", "message": "needs job_id, step, rank"}
                                      for i in bad])
        return {"inserted": store.add_metrics(records)}

    @app.get("/metrics")
    def prometheus():
        lines = ["# TYPE dmuon_jobs gauge"]
        lines += [f'dmuon_jobs{{status="{s}"}} {n}' for s, n in store.counts().items()]
        return PlainTextResponse("\n".join(lines) + "\n")

    return app
