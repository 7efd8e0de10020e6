"""Per-rank step records: a job posts its own (with its job token), anyone who may read
reads them."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse

from ..auth import JobId, guarded
from ..step_records import MAX_STEP, Records, ingest

job_posts = APIRouter(route_class=guarded("job"), tags=["metrics"])
reads = APIRouter(route_class=guarded("read"), tags=["metrics"])


@job_posts.post("/v1/jobs/{job_id}/metrics", max_body_size=4 << 20)
def post_metrics(job_id: JobId, records: Records, request: Request):
    """Records of this job (a retried post stores nothing twice); the job's own token
    or the admin token."""
    store = request.app.state.store
    if store.job_status(job_id) is None:
        raise HTTPException(404, f"no job {job_id!r}")
    wrong = [{"field": f"[{i}].job_id", "message": f"a record of {r.job_id!r}, posted to "
                                                 f"{job_id!r}"}
             for i, r in enumerate(records) if r.job_id != job_id]
    if wrong:
        raise HTTPException(422, wrong)
    return {"inserted": ingest(store, job_id, records, "post")}


@reads.get("/v1/jobs/{job_id}/metrics")
def metrics(job_id: JobId, request: Request, after_step: int = Query(0, ge=0, le=MAX_STEP)):
    store = request.app.state.store
    if store.job_status(job_id) is None:
        raise HTTPException(404, f"no job {job_id!r}")
    return JSONResponse(store.records.all(job_id, after_step))
