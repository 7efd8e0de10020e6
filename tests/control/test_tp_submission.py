"""Tensor-parallel specs the planner cannot run are refused at submission (REST, a real
uvicorn on 127.0.0.1, no Ray), with a 422 naming ``spec.layout.tp`` and the cause: a
degree the model's KV heads do not split into (with the degrees that do), one that does
not divide a node's workers, and a factory model without a TP plan, on /v1/jobs and
/v1/plan alike; a degree that can run is planned as R x N x T. Other refusals name
``spec.<path>`` too, down to the field a section's check names. The dashboard shows
R x N x T and, for an MoE job, the EP degree and each rank's EP coordinate."""

from __future__ import annotations

import os

import pytest
from helpers.service_http import ROOT, Service

USER_MODEL = os.path.join(ROOT, "tests", "data", "user_model")  # mymodels.gpt, no TP plan


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    env = {"DMUON_LOCAL_RAY": "0",
           "PYTHONPATH": os.pathsep.join([ROOT, USER_MODEL])}  # the control plane imports it
    service = Service(str(tmp_path_factory.mktemp("tp")), **env)
    yield service
    service.kill()


def _submit(svc, spec: dict):
    return svc.request("POST", "/v1/jobs", {"spec": {"steps": 2, **spec}, "dry_run": True})


def _refusal(body) -> tuple[list[str], str]:
    return [d["field"] for d in body["detail"]], " ".join(d["message"] for d in body["detail"])


def test_tp_3_on_a_model_with_4_kv_heads_is_refused_naming_the_module(svc):
    model = {"dim": 96, "n_layers": 2, "n_heads": 12, "n_kv_heads": 4, "ffn_dim": 192}
    status, body = _submit(svc, {"model": model,
                                 "layout": {"nodes": 1, "workers_per_node": 3, "tp": 3}})
    fields, message = _refusal(body)
    assert status == 422 and fields == ["spec.layout.tp"], body
    assert "tp = 3 does not divide the 4 KV heads of 'model.layers.0.self_attn.k_proj'" \
        in message


def test_tp_4_with_2_workers_per_node_is_refused_naming_both(svc):
    status, body = _submit(svc, {"model": "tiny",
                                 "layout": {"nodes": 1, "workers_per_node": 2, "tp": 4}})
    fields, message = _refusal(body)
    assert status == 422 and fields == ["spec.layout.tp"], body
    assert "layout.tp=4 must divide the 2 workers per node" in message


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/plan"])
def test_tp_3_with_shard_2_is_refused_naming_spec_layout_tp(svc, path):
    """The service plans on one assumed node of 4 CPUs (no Ray): 3 does not divide 4."""
    spec = {"model": "tiny", "steps": 2, "layout": {"shard": 2, "tp": 3}}
    status, body = svc.request("POST", path, {"spec": spec} if path == "/v1/jobs" else spec)
    fields, message = _refusal(body)
    assert status == 422 and fields == ["spec.layout.tp"], body
    assert message.startswith("layout.tp=3 must divide the 4 workers per node"), message


def test_tp_3_on_8_heads_and_4_kv_heads_names_the_kv_heads_and_the_degrees_that_fit(svc):
    """Neither the 8 heads nor the 4 KV heads split in 3; the KV heads bound T (they
    divide the heads): 1, 2 and 4 divide 8 heads, 4 KV heads, FFN 128 and vocabulary 256."""
    model = {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 128}
    status, body = _submit(svc, {"model": model,
                                 "layout": {"nodes": 1, "workers_per_node": 3, "tp": 3}})
    fields, message = _refusal(body)
    assert status == 422 and fields == ["spec.layout.tp"], body
    assert ("tp = 3 does not divide the 4 KV heads of 'model.layers.0.self_attn.k_proj'; "
            "the degrees that divide every split of this model: 1, 2, 4") in message, message


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/plan"])
def test_refusals_name_spec_and_the_field_a_whole_section_check_names(svc, path):
    """A field's own check, a section's (layout) and the whole spec's (warm-up within
    steps) each name ``spec.<path>`` down to the field, on /v1/plan (whose body is the
    spec) as on /v1/jobs."""
    cases = [({"steps": 0}, "spec.steps"),
             ({"steps": 2, "schedule": {"warmup_steps": 5}}, "spec.schedule.warmup_steps"),
             ({"layout": {"nodes": 2, "elastic": {"max_nodes": 2}}}, "spec.layout.nodes")]
    for spec, field in cases:
        spec = {"model": "tiny", **spec}
        status, body = svc.request("POST", path,
                                   {"spec": spec} if path == "/v1/jobs" else spec)
        assert status == 422 and _refusal(body)[0] == [field], (spec, body)


def test_tp_on_a_factory_model_without_a_plan_is_refused_naming_the_model(svc):
    model = {"factory": "mymodels.gpt:build", "kwargs": {"dim": 32, "layers": 2},
             "vocab_size": 256, "max_seq_len": 64}
    status, body = _submit(svc, {"model": model, "seq_len": 16, "layout": {"tp": 2}})
    fields, message = _refusal(body)
    assert status == 422 and fields == ["spec.layout.tp"], body
    assert "no tensor-parallel plan for GPT" in message and "tp_plan()" in message


def test_a_degree_that_runs_is_planned_as_r_x_n_x_t(svc):
    status, job = _submit(svc, {"model": "tiny", "layout": {"tp": 2}})
    assert status == 201, job
    status, part = svc.request("GET", f"/v1/jobs/{job['id']}/partition")
    mesh = {"replicate": 1, "shard": 2, "nodes": 1, "tp": 2, "ep": 1, "pp": 1}
    assert status == 200 and {k: part["layout"][k] for k in mesh} == mesh
    assert [r["coord"] for r in part["ranks"]] == [[0, 0, 0], [0, 0, 1], [0, 1, 0],
                                                   [0, 1, 1]]
    assert part["tp_size"] == 2 and "tp" in part["ranks"][0]["ledger"]


def test_the_dashboard_shows_r_x_n_x_t_and_each_ranks_coordinate(svc):
    from helpers.browser import job_page

    status, job = _submit(svc, {"model": "tiny", "layout": {"tp": 2}})
    assert status == 201, job
    coords = [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]
    event = {"reason": "start", "previous": None, "layout": [1, 2, 2], "resumed_from": 0,
             "steps_lost": 0}
    records = [{"job_id": job["id"], "step": 1, "rank": rank, "loss": 5.0, "coord": coord,
                "layout": [1, 2, 2], "layout_event": event if rank == 0 else None}
               for rank, coord in enumerate(coords)]
    assert svc.request("POST", f"/v1/jobs/{job['id']}/metrics", records)[1] == {"inserted": 4}
    with job_page(svc.url, job["id"], "running") as (page, facts):
        assert "layout\n1 x 2 x 2 (replicate x shard x tp)" in facts
        assert "running\n1 x 2 x 2" in facts
        assert page.locator("#ownership-chart .barlayer .point").count() == 4
        owners = page.locator("#owners h3").all_inner_texts()
        assert [h.split(":")[0] for h in owners] == [
            "rank 0 (0,0,0)", "rank 1 (0,0,1)", "rank 2 (0,1,0)", "rank 3 (0,1,1)"]
        # the T ranks of a slot hold the same matrices (each its TP shard of them)
        assert owners[0].split(":")[1] == owners[1].split(":")[1]


def test_the_dashboard_shows_the_ep_degree_and_each_ranks_ep_coordinate(svc):
    """The built-in MoE as EP 2 on 1 x 4: the layout reads ``1 x 4, ep 2`` and each rank's
    bar its EP coordinate, its shard index mod 2 (the EP group is 2 consecutive shard
    ranks)."""
    from helpers.browser import job_page

    status, job = _submit(svc, {"model": "small-moe",
                                "layout": {"replicate": 1, "shard": 4, "ep": 2}})
    assert status == 201, job
    event = {"reason": "start", "previous": None, "layout": [1, 4], "resumed_from": 0,
             "steps_lost": 0}
    records = [{"job_id": job["id"], "step": 1, "rank": rank, "loss": 5.0, "coord": [0, rank],
                "layout": [1, 4], "layout_event": event if rank == 0 else None}
               for rank in range(4)]
    assert svc.request("POST", f"/v1/jobs/{job['id']}/metrics", records)[1] == {"inserted": 4}
    with job_page(svc.url, job["id"], "running") as (page, facts):
        assert "layout\n1 x 4, ep 2 (replicate x shard)" in facts
        bars = page.evaluate("document.getElementById('ownership-chart').data[0].x")
        assert bars == ["rank 0 (0,0) ep 0", "rank 1 (0,1) ep 1", "rank 2 (0,2) ep 0",
                        "rank 3 (0,3) ep 1"]
