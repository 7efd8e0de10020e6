"""Pure-DMuon routing through REST: a job whose spec carries the reference guide's
"practical LLM policy" (``dmuon.param_policy``: matrices on Muon, embeddings and the
head on FSDP2's sharded AdamW, norms and biases on AdamW at an owner) runs to SUCCEEDED
on the built-in tiny model, on a real control plane with its own local Ray head (4 CPU
workers, 2 x 2 HSDP, 3 steps), and reports each parameter's route.

The routes are checked against the guide's rules computed here, from the model's
parameter names alone (not from the service's or the core's resolution); the workers
ran the stored partition (its digest in every record; the core refuses a stored plan
whose routes the policy it is given does not make), which holds exactly the Muon and
owner-AdamW params, the latter with no Newton-Schulz FLOPs; and the policy's bf16 compute
reached them and the planner priced it: DMuon's bytes per step are the stored plan's
prediction, half of a float32 pricing."""

from __future__ import annotations

import os

import pytest
from helpers.browser import ARTIFACTS, job_page

from dmuon import planning
from dmuon.partition import DedicationPlan
from service.job.models.builtin import build_model
from service.job.plan_document import partition_digest
from service.job.spec.presets import PRESETS

WORLD, STEPS = 4, 3
# the guide's policy (the reference's "Pure DMuon Routing", "Routing Policy"), dtypes by
# name: bf16 compute, float32 masters and optimizer (the built-in model's own dtype)
POLICY = {
    "defaults": {"route": "muon", "param_dtype": "bf16", "grad_dtype": None,
                 "master_dtype": "fp32", "optim_dtype": "float32"},
    "overrides": [
        {"name": ["embed_tokens", "word_embeddings", "wte", "lm_head"],
         "set": {"route": "sharded_adamw"}},
        {"contains": ["norm", "ln_", ".bias"], "set": {"route": "adamw"}},
        {"name": ["action_head", "action_decoder"],
         "set": {"param_dtype": "fp32", "grad_dtype": "fp32", "output_dtype": "fp32",
                 "cast_forward_inputs": True}},
    ],
}
SPEC = {"name": "pure-dmuon", "model": "tiny", "steps": STEPS, "batch_size": 4,
        "seq_len": 16, "layout": {"replicate": 2, "shard": 2}, "data": {"val_every": 0},
        "dmuon": {"param_policy": POLICY}}


def expected_route(name: str) -> str:
    """The guide's rule, written out: the first override sets the head and embeddings,
    the second the norms and biases, anything else keeps the default."""
    route = "muon"
    if any(t in name for t in ("embed_tokens", "word_embeddings", "wte", "lm_head")):
        route = "sharded_adamw"
    if any(t in name for t in ("norm", "ln_", ".bias")):
        route = "adamw"
    return route


@pytest.fixture(scope="module")
def svc(shared_service):
    """The package's service (tests/system/conftest.py): 4 CPU workers, one job at a time."""
    return shared_service


@pytest.fixture(scope="module")
def job(svc):
    status, job = svc.request("POST", "/v1/jobs", {"spec": SPEC})
    assert status == 201, job
    done = svc.wait_ended(job["id"])
    assert done["status"] == "SUCCEEDED", svc.request("GET", f"/v1/jobs/{job['id']}/logs")[1]
    return job


def _names() -> list[str]:
    return [n for n, _ in build_model(PRESETS["tiny"], device="meta").named_parameters()]


def test_a_pure_dmuon_job_runs_and_reports_each_route(svc, job):
    part = svc.request("GET", f"/v1/jobs/{job['id']}/partition")[1]
    names = _names()
    routes = part["optimizer_split"]["routes"]
    assert list(routes) == names  # every parameter, in the model's order
    assert {n: r["route"] for n, r in routes.items()} == {n: expected_route(n) for n in names}
    # the three routes all occur: the tiny model has embeddings, a head, norms, matrices
    assert {r["route"] for r in routes.values()} == {"muon", "adamw", "sharded_adamw"}
    for name, r in routes.items():  # the defaults' dtypes, no override's
        assert (r["master_dtype"], r["optim_dtype"], r["param_dtype"]) == \
            ("float32", "float32", "bfloat16"), (name, r)
        assert r["matched"] == [i for i, o in enumerate(POLICY["overrides"])
                                if any(t in name for t in (o.get("name") or o["contains"]))]
    # the stored partition: the dedicated params (Muon's and AdamW's at an owner), the
    # AdamW ones with no NS FLOPs; the final norm hooked on its own module
    owned = part["params"]
    assert {a["param"] for a in owned.values()} == {n for n in names
                                                    if expected_route(n) != "sharded_adamw"}
    for a in owned.values():
        assert a["route"] == expected_route(a["param"])
        assert (a["ns_flops"] == 0) == (a["route"] == "adamw"), a
    assert owned["model.norm.weight"]["boundary"] == "model.norm"
    records = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert len(records) == STEPS * WORLD
    # every rank ran the stored partition: dedicate_params(plan=..., param_policy=...)
    # refuses a plan whose routes the policy does not give
    assert {r["partition_digest"] for r in records} == {partition_digest(part)}
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in records)
    # the policy's bf16 reached the workers and the planner priced it: every dedicated
    # param's gathers, reduces and replicate traffic move 2-byte elements, as the stored
    # plan's ledger says byte for byte, and half of a float32 pricing of the same plan
    # (the precision's); the step's own small collectives (flags, norms) keep their size
    fp32 = planning.ledger_prediction(DedicationPlan.from_dict(part), 0, z3=True,
                                      param_bytes=4, reduce_bytes=4)
    assert part["ranks"][0]["ledger"]["shard"]["forward"] == fp32["shard"]["forward"] / 2
    for r in records:
        predicted = part["ranks"][r["rank"]]["ledger"]
        for dim, phases in predicted.items():
            for phase, n in phases.items():
                assert r["bytes"][f"{dim}.{phase}"] == n, (r["rank"], dim, phase)
    assert os.path.isdir(os.path.join(svc.env["DMUON_STORAGE"], job["id"], "export"))


def test_the_job_page_shows_each_parameters_route(svc, job):
    """The dashboard's job page: the route counts among the facts, and one row per
    parameter with its route and dtypes, as the guide's rules give them."""
    names = _names()
    counts = {k: sum(expected_route(n) == k for n in names)
              for k in ("muon", "adamw", "sharded_adamw")}
    with job_page(svc.url, job["id"], "routes") as (page, facts):
        page.wait_for_function(f"document.querySelectorAll('#routes tbody tr').length === "
                               f"{len(names)}")
        rows = page.evaluate("[...document.querySelectorAll('#routes tbody tr')].map("
                             "(tr) => [...tr.cells].map((c) => c.textContent))")
        head = page.evaluate("[...document.querySelectorAll('#routes th')].map("
                             "(th) => th.textContent)")
        os.makedirs(ARTIFACTS, exist_ok=True)
        page.locator("#routes-figure").screenshot(path=os.path.join(ARTIFACTS, "routes.png"))
    assert f"{counts['muon']} muon, {counts['adamw']} adamw, " \
        f"{counts['sharded_adamw']} sharded_adamw" in facts, facts
    assert head[:2] == ["parameter", "route"] and "master" in head, head
    assert [r[:2] for r in rows] == [[n, expected_route(n)] for n in names]
    master = head.index("master")
    assert {(r[master], r[head.index("param")]) for r in rows} == {("float32", "bfloat16")}
