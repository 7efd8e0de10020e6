"""Working directories: a zip of the user's code, uploaded once and named by its
content; jobs refer to it with ``spec.working_dir``."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from service.job.inputs.working_dir import MAX_PACKAGE_BYTES, PackageError, store_package

from ..auth import guarded

admin = APIRouter(route_class=guarded("admin"), tags=["packages"])


@admin.post("/v1/packages", status_code=201, max_body_size=MAX_PACKAGE_BYTES)
async def upload(request: Request):
    """Body: a zip file (``application/zip``). Answers ``{"id": "pkg-...", "files": n}``;
    put the id in a job spec's ``working_dir``."""
    data = await request.body()
    try:
        package_id, files = store_package(request.app.state.settings.storage, data)
    except PackageError as e:
        raise HTTPException(422, [{"field": "body", "message": str(e)}]) from None
    return {"id": package_id, "files": files}
