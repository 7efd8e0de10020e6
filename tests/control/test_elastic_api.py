"""An elastic job through the control plane under real uvicorn (no Ray): the plan's
per-node-count table in ``GET /partition``, a range with no runnable count refused at
submission naming the field, and the layout running and its history (from the layout
events in rank 0's records) in ``GET /v1/jobs/{id}`` and on the dashboard in Chromium."""

from __future__ import annotations

import pytest
from helpers.browser import job_page
from helpers.elastic import SPEC
from helpers.service_http import Service

# three starts as a Ray Train worker group makes them (service.worker.layout_events)
EVENTS = {1: {"reason": "start", "previous": None, "layout": [3, 2], "resumed_from": 0,
              "steps_lost": 0},
          5: {"reason": "capacity lost: 6 -> 4 workers (a node or worker failed)",
              "previous": [3, 2], "layout": [2, 2], "resumed_from": 4, "steps_lost": 1},
          7: {"reason": "capacity returned: 4 -> 6 workers", "previous": [2, 2],
              "layout": [3, 2], "resumed_from": 6, "steps_lost": 1}}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def svc(request, tmp_path_factory):
    env = {"DMUON_LOCAL_RAY": "0", "DMUON_LOCAL_CPUS": "2"}
    if request.param == "postgresql":
        env["DMUON_DATABASE_URL"] = request.getfixturevalue("postgres").database()
    service = Service(str(tmp_path_factory.mktemp(request.param)), **env)
    yield service
    service.kill()


def _records(job_id: str) -> list[dict]:
    """Rank 0's and 1's records of steps 1-10 as the job would post them, the layout
    events where each start's first step is."""
    out = []
    for step in range(1, 11):
        layout = [2, 2] if 5 <= step <= 6 else [3, 2]
        for rank in (0, 1):
            out.append({"job_id": job_id, "step": step, "rank": rank, "loss": 5.0,
                        "layout": layout,
                        "layout_event": EVENTS.get(step) if rank == 0 else None})
    return out


def test_the_plan_has_a_layout_per_node_count_and_the_job_its_layout_history(svc):
    status, job = svc.request("POST", "/v1/jobs", {"spec": SPEC, "dry_run": True})
    assert status == 201, job
    table = svc.request("GET", f"/v1/jobs/{job['id']}/partition")[1]["elastic"]
    assert [(e["layout"]["replicate"], e["layout"]["shard"]) for e in table] == [(2, 2), (3, 2)]
    assert [(e["micro_batches"], e["rows_per_micro"]) for e in table] == [(3, 1), (1, 2)]
    assert [len(e["memory"]) for e in table] == [4, 6] and not any(e["refused"] for e in table)
    assert svc.request("GET", f"/v1/jobs/{job['id']}")[1]["layouts"] == []
    path = f"/v1/jobs/{job['id']}/metrics"
    assert svc.request("POST", path, _records(job["id"]))[1] == {"inserted": 20}
    layouts = svc.request("GET", f"/v1/jobs/{job['id']}")[1]["layouts"]
    assert layouts == [{"step": s, **e} for s, e in EVENTS.items()]
    with job_page(svc.url, job["id"], "layout history") as (_, facts):
        assert "elastic layouts\n2 x 2, 3 x 2" in facts
        assert "running\n3 x 2" in facts
        assert ("layout history\n3 x 2 from step 1; 2 x 2 from step 5 (capacity lost: 6 -> 4 "
                "workers (a node or worker failed); 1 step lost); 3 x 2 from step 7 "
                "(capacity returned: 4 -> 6 workers; 1 step lost)") in facts


def test_a_range_that_no_node_count_can_run_is_refused_naming_the_field(svc):
    spec = {**SPEC, "global_batch_tokens": 7 * 32}  # 7 sequences: no even split over 4 or 6
    status, body = svc.request("POST", "/v1/jobs", {"spec": spec})
    assert status == 422, body
    (detail,) = body["detail"]
    assert detail["field"] == "spec.layout.elastic"
    assert detail["message"].startswith("layout.elastic: no node count in the range can run: "
                                        "2 node(s): global_batch_tokens: 7 sequences")
    bad = {**SPEC, "layout": {"elastic": {"min_nodes": 1, "max_nodes": 2,
                                          "start_timeout_s": 0}}}
    status, body = svc.request("POST", "/v1/jobs", {"spec": bad})
    assert status == 422 and body["detail"][0]["field"] == "spec.layout.elastic.start_timeout_s"
    assert len(svc.request("GET", "/v1/jobs")[1]) == 1  # only the first test's job
