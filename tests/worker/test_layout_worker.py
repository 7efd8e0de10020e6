"""The stored plan is the workers' only input (issue 51, item 2): nothing the workers
run imports the planner (``service.job.plan``), directly or through the job model they
share; ``Job.plan`` has no ``None`` path; and each worker reports the ``Layout`` it ran,
which equals the one the planner chose and the driver handed it, field by field, for a
2-D, a 3-D (TP) and an EP layout."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from helpers.layouts import BASE, CASES, handed, spec_of, stored
from test_architecture import modules, reachable

from dmuon.testing import run
from service.job.job import Job
from service.job.layout import Layout
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.layout_choice import choose_layout
from service.job.plan.make import plan_document, plan_on_one_host

PLANNER = "service.job.plan"


def test_nothing_the_workers_run_imports_the_planner():
    workers = [m for m in modules() if m.startswith("service.worker")]
    assert workers
    bad = {}
    for start in workers:
        seen = reachable(start)
        for mod in seen:
            if mod == PLANNER or mod.startswith(PLANNER + "."):
                bad[start] = f"{mod} (imported by {seen[mod]})"
    assert not bad, bad


def test_a_job_always_has_its_plan():
    fields = {f.name: f for f in dataclasses.fields(Job)}
    assert fields["plan"].default is dataclasses.MISSING
    assert "None" not in str(fields["plan"].type)
    assert inspect.signature(Job.local).parameters["plan"].default is inspect.Parameter.empty


def _ran(rank, world, spec: dict, plan_json: str):
    """One worker as ``_worker`` runs one: the mesh built from the handed plan's Layout
    (its ranks in order, ``workers_per_node`` to a host), then the loop; returns the
    layout it reported."""
    from service.job.plan_document import PlanDocument
    from service.worker.loop import run_training
    from service.worker.mesh import build_mesh

    plan = PlanDocument.model_validate_json(plan_json).for_world(world)
    job = Job.local(spec, plan)
    records = []
    run_training(job, build_mesh(plan.layout), lambda r, p: records.append(r))
    return records[0]["ran_layout"]


@pytest.mark.parametrize("case", CASES)
def test_the_workers_report_the_layout_they_were_handed(case, monkeypatch, tmp_path):
    fields, hosts, cpus, expected = CASES[case]
    spec, nodes = spec_of(fields), synthetic_inventory(hosts, 0, cpus_per_node=cpus)
    chosen = choose_layout(nodes, spec)
    job_plan = handed(spec, stored(plan_document(spec, nodes, cpus)), nodes, monkeypatch,
                      tmp_path)
    reports = run(_ran, spec.model_dump(mode="json"), job_plan.model_dump_json(),
                  world_size=chosen.world_size)
    for reported in reports:
        assert reported == dataclasses.asdict(chosen) == dataclasses.asdict(expected)
        assert Layout(**reported) == chosen


def test_plan_on_one_host_is_the_planners_plan():
    """What tests and benchmarks hand ``Job.local``: a plan the planner made."""
    plan = plan_on_one_host({**BASE, "model": "tiny"}, 2)
    assert plan.layout == Layout(1, 2, 1, workers_per_node=2, micro_batches=1,
                                 rows_per_micro=1)
    assert plan.complete and plan.inventory.source == "cluster"
