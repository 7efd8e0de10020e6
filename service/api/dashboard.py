"""The dashboard at ``/``: a static page over the REST API and the event stream.

Charts come from Plotly's own bundle, served from the installed ``plotly`` package
(pinned in requirements.lock), so the page needs no network and no build step.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = resources.files("service.api") / "static"


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

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")
