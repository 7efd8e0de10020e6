"""The control plane: FastAPI routers over the job store, the planner and Ray's job API.

    dmuon-serve                      (or: uvicorn service.control.app:create_app --factory)

Settings: ``service.control.settings``. The routers are in ``service.control.routes``; who may
call what is ``service.control.auth``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import threading

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError

from service.job.spec import field_path, named_field
from service.job.spec.spec_files import position

from .body_limit import JSONBodyLimit
from .dashboard import mount_dashboard
from .routes import jobs, metrics, packages, streams, system
from .settings import Settings
from .store import JobStore

DEFAULT_BODY_BYTES = 64 << 10  # routes that take more say so (metric posts)


async def _start_runner(app: FastAPI) -> None:
    """Attach to RAY_ADDRESS, or to the local head the service keeps (started if none
    answers: a separate process, so a restarted service re-attaches)."""
    settings = app.state.settings
    address = settings.ray_address
    if address is None and settings.local_ray:
        from .ray_head import LocalRayHead

        head, reattached = await asyncio.to_thread(
            LocalRayHead.attach_or_start, settings.storage, settings.local_cpus)
        app.state.local_head = head
        print(f"{'re-attached to' if reattached else 'started'} the local Ray head at "
              f"{head.address} (dashboard {head.dashboard}, pid {head.pid})", flush=True)
        address = head.dashboard
    if address:
        from .submitter import RayJobRunner

        app.state.runner = RayJobRunner(
            app.state.store, address, storage=settings.storage,
            data_root=settings.data_dir(), service_url=settings.service_url,
            max_running=settings.max_running)
        app.state.runner.start()


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    if app.state.settings.token() is None:
        print("warning: DMUON_API_TOKEN is unset: no authentication; the service answers "
              "only to loopback Host names (DMUON_ALLOWED_HOSTS adds others)",
              file=sys.stderr, flush=True)
    await _start_runner(app)
    # what imports and start-up made lives as long as the process: frozen out of the
    # collector's reach, a full collection no longer stalls every open request
    gc.freeze()
    yield
    if app.state.runner is not None:
        app.state.runner.close()
        if app.state.local_head is not None and not app.state.settings.keep_ray:
            # the head is about to go: its jobs stop as on a cancel, first
            await asyncio.to_thread(app.state.runner.stop_all)
    app.state.store.close()
    await _leave_local_head(app)


async def _leave_local_head(app: FastAPI) -> None:
    """On a shutdown (Ctrl-C, SIGTERM), stop the local head the service ran on, by PID,
    unless ``DMUON_KEEP_RAY`` keeps it for the next service (which re-attaches). A
    SIGKILLed service leaves it running, as a kept one."""
    from .ray_head import STATE_FILE, stop_head

    head, settings = app.state.local_head, app.state.settings
    if head is None:
        return
    if settings.keep_ray:
        print(f"kept the local Ray head (pid {head.pid}); the next dmuon-serve re-attaches "
              "to it, dmuon-serve --stop-ray stops it", flush=True)
        return
    await asyncio.to_thread(stop_head, head, settings.storage)
    print(f"stopped the local Ray head (pid {head.pid}; recorded in "
          f"{settings.storage}/{STATE_FILE})", flush=True)


SPEC_BODIES = ("/v1/plan",)  # routes whose whole body is a job spec: named spec.<path>


def _error_entry(error: dict, body, spec_body: bool) -> dict:
    """``{"field", "message"}``; a body that is not JSON is named by line and column. A
    spec's field is ``spec.<path>``, down to the field its message names when a check of
    a whole section or spec names one (``spec.layout.tp``, not ``spec``)."""
    if error["type"] == "json_invalid" and isinstance(body, str):
        line, column = position(body, error["loc"][1])
        return {"field": "body", "message": f"not valid JSON: {error['ctx']['error']}: "
                                            f"line {line}, column {column}"}
    loc = tuple(error["loc"])
    if loc[:1] == ("body",):
        loc = ("spec",) * spec_body + loc[1:]
    field = field_path(loc) or "body"
    if field == "spec" or field.startswith("spec."):
        named = named_field(error["msg"])
        within = field.removeprefix("spec").removeprefix(".")
        if named and (not within or named.startswith(f"{within}.")):
            field = f"spec.{named}"
    return {"field": field, "message": error["msg"]}


async def _invalid(request: Request, exc: RequestValidationError):
    """422 with one entry per field, by the path the user wrote (``spec.optimizer.lr``);
    never the offending input, which may not be JSON (NaN)."""
    spec_body = request.url.path in SPEC_BODIES
    by_field: dict[str, list[str]] = {}
    for e in exc.errors():  # a union's members each refuse the one field: one entry
        entry = _error_entry(e, exc.body, spec_body)
        by_field.setdefault(entry["field"], []).append(entry["message"])
    detail = [{"field": f, "message": "; or ".join(dict.fromkeys(m))} for f, m in by_field.items()]
    return JSONResponse({"detail": detail}, status_code=422)


async def _store_failed(request: Request, exc: DBAPIError):
    return JSONResponse({"detail": f"the job store failed: {type(exc.orig).__name__}: "
                                   f"{str(exc.orig).splitlines()[0] if exc.orig else exc}"},
                        status_code=503, headers={"Retry-After": "5"})


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    app = FastAPI(title="DMuon control plane", version=system.VERSION, lifespan=_lifespan,
                  max_body_size=DEFAULT_BODY_BYTES)
    app.state.settings, app.state.runner, app.state.local_head = settings, None, None
    app.state.store = JobStore(settings.store_url())
    app.state.plans = threading.BoundedSemaphore(settings.max_concurrent_plans)
    app.state.prometheus = system.registry_for(app.state.store)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(DBAPIError, _store_failed)
    for router in (system.public, system.reads, jobs.admin, jobs.reads, jobs.job_posts,
                   metrics.job_posts,
                   metrics.reads, streams.reads, streams.admin, packages.admin):
        app.include_router(router)
    mount_dashboard(app)
    # outside FastAPI's body limit, which sits outside every add_middleware one
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: JSONBodyLimit(build())
    return app
