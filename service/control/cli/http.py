"""The control plane's REST API as the CLI calls it: one request, and a job's
server-sent events parsed into ``(event, data, id)``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import requests

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV, TOKEN_ENV = "DMUON_URL", "DMUON_API_TOKEN"


class ServiceError(RuntimeError):
    """The service could not be reached, or answered 4xx/5xx; the message says which."""


def base_url() -> str:
    return os.environ.get(URL_ENV, DEFAULT_URL).rstrip("/")


def request(method: str, path: str, body=None, *, stream=False, data=None, content_type=None):
    """The service's answer (parsed JSON, or text), or the open response with
    ``stream``; ``DMUON_API_TOKEN`` goes as the bearer token."""
    url = base_url() + path
    token = os.environ.get(TOKEN_ENV)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if content_type:
        headers["Content-Type"] = content_type
    try:
        resp = requests.request(method, url, json=body, data=data, headers=headers,
                                stream=stream,
                                timeout=(10, None if stream else 60))
    except requests.RequestException as e:
        raise ServiceError(f"cannot reach {url}: {e}") from None
    if resp.status_code >= 400:
        raise ServiceError(refusal(resp.status_code, resp.reason, resp.text))
    if stream:
        return resp
    try:
        return resp.json()
    except ValueError:
        return resp.text


def refusal(status: int, reason: str, text: str) -> str:
    """An error answer for a terminal: FastAPI's ``{"detail": "..."}`` as its message, a
    422's ``{"detail": [{"field", "message"}]}`` as one ``field: message`` line each;
    anything else as the service sent it (its first 2000 characters)."""
    head = f"{status} {reason}"
    try:
        detail = json.loads(text)["detail"]
    except (ValueError, TypeError, KeyError):
        return f"{head}: {text[:2000]}"
    if isinstance(detail, str):
        return f"{head}: {detail}"
    if isinstance(detail, list) and detail and all(
            isinstance(d, dict) and {"field", "message"} <= set(d) for d in detail):
        lines = [f"  {d['field']}: {d['message']}" for d in detail]
        return "\n".join([f"the service refused the request ({head}):", *lines])
    return f"{head}: {text[:2000]}"


def job_events(job_id: str) -> Iterator[tuple[str, dict, str | None]]:
    """``GET /v1/jobs/{id}/events`` until the service ends the stream (the job ended and
    every record was sent): ``("status", {"status": ...}, None)`` and
    ``("metrics", record, id)``. Keep-alive comments are skipped."""
    try:
        with request("GET", f"/v1/jobs/{job_id}/events", stream=True) as resp:
            event, event_id, data = "message", None, []
            for line in resp.iter_lines(decode_unicode=True):
                if line == "":  # an event ends at a blank line
                    if data:
                        yield event, json.loads("\n".join(data)), event_id
                    event, event_id, data = "message", None, []
                elif line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
            if data:
                yield event, json.loads("\n".join(data)), event_id
    except requests.RequestException as e:
        raise ServiceError(f"the event stream of {job_id} broke: {e}") from None
