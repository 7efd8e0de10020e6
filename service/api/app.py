"""The control plane: FastAPI over the job store, the planner and Ray's job API.

    uvicorn service.app:create_app --factory --host 127.0.0.1 --port 8000

Settings (``service.settings``) come from the environment: ``DMUON_API_TOKEN`` (bearer
token for every mutating endpoint and for logs), ``DMUON_PROTECT_READS=1`` (reads need
it too), ``DMUON_DB`` (SQLite path) or ``DMUON_DATABASE_URL`` (``sqlite:///path``),
``DMUON_STORAGE`` (job directories), ``RAY_ADDRESS`` (Ray's dashboard address for the
job API; unset: the service starts a local head on 127.0.0.1, or with
``DMUON_LOCAL_RAY=0`` only queues jobs), ``DMUON_LOCAL_CPUS``, ``DMUON_MAX_RUNNING``,
``DMUON_SERVICE_URL`` (where jobs post metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from typing import Literal

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from .dashboard import mount_dashboard
from .planner import NodeInfo, PlacementError, predict, synthetic_inventory
from .settings import Settings
from .spec import JobSpec
from .store import STATES, TERMINAL, JobStore

VERSION = "0.1.0"


class JobSubmission(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: JobSpec
    dry_run: bool = False


def _plan(spec: JobSpec, settings: Settings, cluster: list[NodeInfo] | None) -> dict:
    """The placement as JSON: layout, per-rank predictions, the partition, and the nodes
    it was planned on. Those are the attached cluster's when the job fits them now, as the
    job's entrypoint will plan when it starts; else (no cluster, or one that must grow
    first) ``layout.nodes`` assumed nodes of ``DMUON_LOCAL_CPUS`` CPUs."""
    try:
        if not cluster:
            raise PlacementError("no Ray cluster attached" if cluster is None else
                                 "the Ray cluster lists no alive node")
        placement = predict(spec, cluster)
        inventory = {"source": "cluster", "nodes": len(cluster)}
    except PlacementError as on_cluster:
        nodes = spec.layout.nodes if spec.layout.nodes != "auto" else 1
        placement = predict(spec, synthetic_inventory(nodes, 0,
                                                      cpus_per_node=settings.local_cpus))
        inventory = {"source": "assumed", "nodes": nodes,
                     "cpus_per_node": settings.local_cpus, "reason": str(on_cluster)}
    return {
        "layout": {"replicate": placement.replicate, "shard": placement.shard,
                   "nodes": placement.nodes},
        "inventory": inventory,
        "ranks": [r.__dict__ for r in placement.ranks],
        "partition": placement.plan.to_dict(),
    }


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    store = JobStore(settings.sqlite_path())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        address = settings.ray_address
        if address is None and settings.local_ray:
            from .local_ray import LocalRayHead

            # a separate process that outlives us: a restarted service re-attaches
            head, reattached = await asyncio.to_thread(
                LocalRayHead.attach_or_start, settings.storage, settings.local_cpus)
            print(f"{'re-attached to' if reattached else 'started'} the local Ray head at "
                  f"{head.address} (dashboard {head.dashboard})", flush=True)
            address = head.dashboard
        if address:
            from .runner import RayJobRunner

            app.state.runner = RayJobRunner(store, address, settings.storage,
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

    def read_access(authorization: str | None = Header(None)) -> None:
        if settings.protect_reads:
            require_token(authorization)

    def cluster() -> list[NodeInfo] | None:
        return app.state.runner.inventory() if app.state.runner is not None else None

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

    @app.post("/v1/plan", dependencies=[Depends(read_access)])
    def plan(spec: JobSpec):
        try:
            return _plan(spec, settings, cluster())
        except PlacementError as e:
            raise HTTPException(422, [{"field": "layout", "message": str(e)}]) from None

    @app.post("/v1/jobs", status_code=201, dependencies=[Depends(require_token)])
    def submit(body: JobSubmission, idempotency_key: str | None = Header(None)):
        try:
            planned = _plan(body.spec, settings, cluster())
        except PlacementError as e:
            raise HTTPException(422, [{"field": "spec.layout", "message": str(e)}]) from None
        spec = body.spec.model_dump(mode="json")
        job = store.create_job(body.spec.name, spec, dry_run=body.dry_run, plan=planned,
                               idempotency_key=idempotency_key,
                               status="SUCCEEDED" if body.dry_run else "PENDING")
        if (job["spec"], job["dry_run"]) != (spec, body.dry_run):
            raise HTTPException(409, f"Idempotency-Key {idempotency_key!r} was used for "
                                     f"another request (job {job['id']})")
        return job

    @app.get("/v1/jobs", dependencies=[Depends(read_access)])
    def jobs(status: Literal[STATES] | None = None,
             limit: int = Query(100, ge=1, le=100_000)):
        return [{k: v for k, v in j.items() if k != "plan"}
                for j in store.list_jobs(status, limit)]

    @app.get("/v1/jobs/{job_id}", dependencies=[Depends(read_access)])
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

    @app.get("/v1/jobs/{job_id}/partition", dependencies=[Depends(read_access)])
    def partition(job_id: str):
        planned = job_or_404(job_id)["plan"]
        return {"layout": planned["layout"], "inventory": planned.get("inventory"),
                "ranks": planned["ranks"], **planned["partition"]}

    @app.get("/v1/jobs/{job_id}/metrics", dependencies=[Depends(read_access)])
    def metrics(job_id: str, after_step: int = Query(0, ge=0)):
        job_or_404(job_id)
        return store.metrics(job_id, after_step)

    @app.get("/v1/jobs/{job_id}/logs", dependencies=[Depends(require_token)])
    def logs(job_id: str, follow: bool = False):
        """The job driver's output; ``follow=true`` streams it until the job ends."""
        found, runner = job_or_404(job_id), app.state.runner
        if runner is None or found["dry_run"] or found["status"] == "PENDING":
            return PlainTextResponse("")
        if follow:
            return StreamingResponse(runner.tail(job_id), media_type="text/plain")
        return PlainTextResponse(runner.logs(job_id))

    @app.get("/v1/jobs/{job_id}/events", dependencies=[Depends(read_access)])
    async def events(job_id: str, poll_s: float = Query(0.5, ge=0.05, le=10),
                     last_event_id: int = Header(0, ge=0)):
        """Server-sent events: ``metrics`` (one per record, ``id`` = its row, so a
        client reconnecting with ``Last-Event-ID`` misses nothing) and ``status``."""
        job_or_404(job_id)

        async def stream():
            row, status, quiet = last_event_id, None, 0.0
            while True:
                fresh = await asyncio.to_thread(store.metrics_after_row, job_id, row)
                for row, rec in fresh:  # noqa: B020 - the cursor moves past each record
                    quiet = 0.0
                    yield f"id: {row}\nevent: metrics\ndata: {json.dumps(rec)}\n\n"
                current = store.get_job(job_id)["status"]
                if current != status:
                    status = current
                    yield f"event: status\ndata: {json.dumps({'status': status})}\n\n"
                if status in TERMINAL:
                    return
                if quiet >= 15:  # keeps proxies from closing an idle stream
                    quiet = 0.0
                    yield ": keep-alive\n\n"
                await asyncio.sleep(poll_s)
                quiet += poll_s

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/metrics", dependencies=[Depends(require_token)])
    def ingest(records: list[dict]):
        bad = [i for i, r in enumerate(records) if not {"job_id", "step", "rank"} <= set(r)]
        if bad:
            raise HTTPException(422, [{"field": f"{i}", "message": "needs job_id, step, rank"}
                                      for i in bad])
        return {"inserted": store.add_metrics(records)}

    @app.get("/metrics", dependencies=[Depends(read_access)])
    def prometheus():
        lines = ["# TYPE dmuon_jobs gauge"]
        lines += [f'dmuon_jobs{{status="{s}"}} {n}' for s, n in store.counts().items()]
        return PlainTextResponse("\n".join(lines) + "\n")

    mount_dashboard(app)
    return app
