"""Schemathesis over the control plane's OpenAPI document (real uvicorn, no Ray), with
the token and without it, and against a service that has none: no request it generates
gets a 5xx, every 422 names its fields, no mutation passes without the token, and the
service stays up. Hand-made hostile inputs (non-finite floats, lone surrogates, huge
integers, NUL bytes) go to every operation too. Examples per operation are bounded; job
submissions are dry runs."""

from __future__ import annotations

import itertools

import pytest
import schemathesis
from helpers.paths import ROOT
from helpers.service_http import Service
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

SPEC_OPERATIONS = (("POST", "/v1/jobs"), ("POST", "/v1/plan"))
MUTATING = [("POST", "/v1/jobs"), ("POST", "/v1/jobs/x/cancel"), ("POST", "/v1/plan"),
            ("POST", "/v1/jobs/x/metrics"), ("GET", "/v1/jobs/x/logs"),
            ("POST", "/v1/jobs/register")]


@pytest.fixture(scope="module", params=["token", "no-token"])
def svc(request, tmp_path_factory):
    token = "secret-token" if request.param == "token" else None
    service = Service(str(tmp_path_factory.mktemp("openapi")), token=token,
                      DMUON_LOCAL_RAY="0")
    yield service
    service.kill()


def _check(case, svc, seen: dict, send_token: bool) -> None:
    seen[case.method, case.path] = seen.get((case.method, case.path), 0) + 1
    if case.path == "/v1/jobs" and case.method == "POST" and isinstance(case.body, dict):
        case.body["dry_run"] = True
    headers = {"Authorization": f"Bearer {svc.token}"} if send_token and svc.token else {}
    response = case.call(headers=headers, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if not headers and svc.token and case.method == "POST" and response.status_code != 413:
        assert response.status_code in (401, 404, 422) or case.path.endswith("/metrics"), \
            (case.path, response.status_code)
    if headers and case.meta.generation.mode == GenerationMode.NEGATIVE and (
            case.method, case.path) in SPEC_OPERATIONS:
        # a body that is not JSON at all cannot be a spec: 400, as FastAPI parses it
        allowed = (422,) if not isinstance(case.body, bytes) else (400, 422)
        assert response.status_code in allowed, (case.body, response.text)
    if response.status_code == 422:
        detail = response.json()["detail"]
        assert detail and all(d["field"] is not None and d["message"] for d in detail)


@pytest.mark.parametrize("send_token", [True, False])
def test_generated_requests_get_no_5xx_and_422s_name_fields(svc, send_token):
    # the two streams stay open while a job runs; the end-to-end test covers them
    schema = schemathesis.openapi.from_url(f"{svc.url}/openapi.json").exclude(
        path_regex=r"/(events|logs)$")
    operations = [result.ok() for result in schema.get_all_operations()]
    seen: dict = {}
    for operation, mode in itertools.product(operations, GenerationMode):
        if mode == GenerationMode.NEGATIVE and (operation.method.upper(),
                                                operation.path) not in SPEC_OPERATIONS:
            continue  # invalid specs are the point; a bad job id is only a 404
        run = settings(max_examples=15, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))(
            given(case=operation.as_strategy(generation_mode=mode))(
                lambda case: _check(case, svc, seen, send_token)))
        run()
    assert len(seen) == len(operations) >= 9  # every operation was exercised
    assert svc.request("GET", "/healthz")[0] == 200 and svc.proc.poll() is None


HOSTILE = [b'{"spec": {"optimizer": {"lr": 1e999}}, "dry_run": true}',
           b'{"spec": {"optimizer": {"lr": NaN}}, "dry_run": true}',
           b'{"spec": {"name": "\\ud800"}, "dry_run": true}',
           b'{"spec": {"name": "a\\u0000b"}, "dry_run": true}',
           b'{"spec": {"steps": 100000000000000000000}, "dry_run": true}',
           b'[{"job_id": "\\udfff", "step": 100000000000000000000, "rank": NaN}]',
           b'{"model": {"dim": 1e999}}', b"[" * 5000 + b"]" * 5000, b"\xff\xfe"]
PATHS = ["/v1/jobs", "/v1/plan", "/v1/jobs/register", "/v1/jobs/dmuon-000000000000/cancel",
         "/v1/jobs/dmuon-000000000000/metrics", "/v1/jobs/x%00y/metrics",
         "/v1/jobs/\\ud800/cancel"]


def test_hostile_inputs_to_every_operation_get_4xx(svc):
    for path in PATHS:
        for body in HOSTILE:
            for token in (True, False):
                status, answer = svc.request("POST", path, data=body, token=token)
                assert 400 <= status < 500, (path, body[:60], status, answer)
    for query in ("after_step=100000000000000000000", "after_step=NaN", "after_step=-1"):
        assert svc.request("GET", f"/v1/jobs/dmuon-000000000000/metrics?{query}")[0] in (
            404, 422)
    assert svc.request("GET", "/v1/jobs?limit=100000000000000000000")[0] == 422
    assert svc.proc.poll() is None


@pytest.mark.parametrize("method,path", MUTATING)
def test_mutations_and_logs_without_the_token_get_401(svc, method, path):
    body = {"spec": {"model": "tiny"}, "dry_run": True} if path == "/v1/jobs" else (
        [] if path.endswith("/metrics") else None)
    if svc.token is None:  # no token to refuse: a cross-site change is refused instead
        if method == "POST" and not path.endswith("/metrics"):
            assert svc.request(method, path, body, headers={"Origin": "http://evil"})[0] == 403
        else:  # reads, and a job's own posts, which need its token
            assert svc.request(method, path, body, token=False)[0] in (200, 401, 404)
        return
    assert svc.request(method, path, body, token=False)[0] == 401
    assert svc.request(method, path, body, headers={"Authorization": "Bearer wrong"},
                       token=False)[0] == 401


def test_one_default_for_the_mode_in_rest_the_cli_and_the_docs(svc):
    """REST's schema and its plans, ``python -m service.job.plan`` and the pages that name
    the default (README's and jobs.md's job.yaml) say the same ``dmuon.mode``."""
    import pathlib
    import re

    from service.job.plan.__main__ import parser

    schemas = svc.request("GET", "/openapi.json")[1]["components"]["schemas"]
    rest = schemas["DMuonSpec"]["properties"]["mode"]["default"]
    _, plan = svc.request("POST", "/v1/plan", {"model": "tiny"})
    assert plan["modes"]["dmuon"] == rest == "z3"
    assert plan["modes"]["reason"].startswith("the default: the spec sets no dmuon.mode (z3;")
    # unset, python -m service.job.plan leaves the mode to the spec and its help names it
    assert parser().get_default("mode") is None
    assert f"(default: {rest})" in next(a.help for a in parser()._actions if a.dest == "mode")
    root = pathlib.Path(ROOT)
    said = [(page, m[1]) for page in ("README.md", "docs/jobs.md")
            for m in re.finditer(r"dmuon: \{mode: \w+\}.*\(default (\w+)\)",
                                 (root / page).read_text())]
    assert [page for page, _ in said] == ["README.md", "docs/jobs.md"]
    assert {mode for _, mode in said} == {rest}

