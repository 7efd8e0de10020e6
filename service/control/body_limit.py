"""A request body over a route's limit answered in JSON naming the limit: Starlette's
body limit answers a bare ``413 Content Too Large`` in text/plain, which a client
reading ``detail`` (``dmuon-svc``, the dashboard) cannot show."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else \
        f"{n >> 10} KiB" if n % 1024 == 0 else f"{n} bytes"


class JSONBodyLimit:
    """Pure ASGI: a text/plain 413 replaced by ``{"detail": "... at most 64 KiB ...",
    "max_body_bytes": 65536}``; a route's own 413 (JSON already) passes as it is."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        replaced = False

        async def send_json(message):
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] == 413 \
                    and _plain(message):
                replaced = True
                limit = scope.get(MAX_BODY_SIZE_SCOPE_KEY)
                shown = f"at most {_size(limit)}" if limit is not None else "smaller"
                body = {"detail": f"the request body is too large: {scope['method']} "
                                  f"{scope['path']} takes a body of {shown}",
                        "max_body_bytes": limit}
                await JSONResponse(body, status_code=413)(scope, receive, send)
                return
            if not replaced:  # the plain response's body is dropped
                await send(message)

        await self.app(scope, receive, send_json)


def _plain(message) -> bool:
    headers = dict(message.get("headers") or [])
    return headers.get(b"content-type", b"").startswith(b"text/plain")
