"""Who may call what, checked before a request's body is read.

Routes are made with ``GuardedRoute`` subclasses per access level (``public``, ``read``,
``admin``, ``job``), so the check runs ahead of FastAPI's body parsing. The admin token
(``DMUON_API_TOKEN``) opens everything; a job's own token (a file in its directory, never
in Ray's job info) opens only that job's metric posts. Without an admin token the
service answers only to loopback Host names (or ``DMUON_ALLOWED_HOSTS``), and a
cross-site browser request may never change anything.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import HTTPException, Path, Request
from fastapi.routing import APIRoute

SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
JOB_ID = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
JobId = Annotated[str, Path(pattern=JOB_ID, description="dmuon-<12 hex digits>")]


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _same(presented: str, expected: str) -> bool:
    # bytes: compare_digest refuses non-ASCII str, and a header may carry any byte
    return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"),
                               expected.encode("utf-8", "surrogatepass"))


def _unauthorised(why: str) -> HTTPException:
    return HTTPException(401, why, headers={"WWW-Authenticate": "Bearer"})


def _check_origin(request: Request, hosts: set[str] | None) -> None:
    """Host (without a token: a name we answer to; defeats DNS rebinding) and, for any
    change, Origin: a browser sends it cross-site, and it must be this service."""
    host = request.headers.get("host", "")
    if hosts is not None and urlsplit(f"//{host}").hostname not in hosts and host not in hosts:
        raise HTTPException(403, f"Host {host!r} is not served without DMUON_API_TOKEN; "
                                 "set a token or DMUON_ALLOWED_HOSTS")
    if request.method in SAFE_METHODS:
        return
    origin = request.headers.get("origin")
    if request.headers.get("sec-fetch-site") == "cross-site" or (
            origin is not None and urlsplit(origin).netloc != host):
        raise HTTPException(403, "cross-site request refused")


def check(request: Request, access: str) -> None:
    settings = request.app.state.settings
    expected = settings.token()
    _check_origin(request, None if expected else settings.hosts())
    if access == "public" or (access == "read" and not settings.protect_reads):
        return
    presented = _bearer(request)
    if expected and presented and _same(presented, expected):
        return
    job_id = request.path_params.get("job_id", "")
    if access == "job" and presented and re.match(JOB_ID, job_id):
        stored = request.app.state.store.queue.job_token_hash(job_id)
        if stored and _same(token_hash(presented), stored):
            return
    if expected or access == "job":
        raise _unauthorised("missing or wrong bearer token")


def guarded(access: str) -> type[APIRoute]:
    """A route class whose handler checks ``access`` before anything else runs."""

    class GuardedRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def guarded_handler(request: Request):
                check(request, access)
                return await handler(request)

            return guarded_handler

    GuardedRoute.__name__ = f"{access.capitalize()}Route"
    return GuardedRoute
