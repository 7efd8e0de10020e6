"""The dashboard at ``/``: a static page over the REST API and the event stream.

Charts come from Plotly's own bundle, served from the installed ``plotly`` package
(pinned in requirements.lock), so the page needs no network and no build step. The
memory kinds (the job model's ``MEMORY_KINDS``, dmuon's) reach the page from here: one
colour per kind in every memory chart.
"""

from __future__ import annotations

import json
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from service.job.plan_document import MEMORY_KINDS

STATIC = resources.files("service.control") / "static"


def _plotly_bundle() -> str:
    return str(resources.files("plotly") / "package_data" / "plotly.min.js")


def mount_dashboard(app: FastAPI) -> None:
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index():
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon():
        return FileResponse(str(STATIC / "favicon.svg"), media_type="image/svg+xml")

    @app.get("/vendor/plotly.min.js", include_in_schema=False)
    def plotly():
        return FileResponse(_plotly_bundle(), media_type="text/javascript",
                            headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/memory-kinds.js", include_in_schema=False)
    def memory_kinds():
        return Response(f"const MEMORY_KINDS = {json.dumps(list(MEMORY_KINDS))};\n",
                        media_type="text/javascript")

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
