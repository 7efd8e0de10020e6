"""One job, one model built on the meta device per plan and per worker start (issue 44,
increment 4): the planner partitions the one build for every layout it weighs (``tp:
auto`` predicting each degree when none fits, an elastic range each node count), and a
worker builds once when it starts. ``run_training`` takes the job, the mesh, the report
and the worker's context, no more. Builds are counted by wrapping the one function that
makes them (``service.job.models.build.build_on_meta``). And (issue 51) one
submission's inputs are resolved once and its model built on meta once before the
workers: counted, by side, on the traced submission of ``tests/helpers/job_path.py``."""

from __future__ import annotations

import inspect

import pytest

from dmuon.testing import run
from service.job.models import build
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.make import plan_document
from service.job.spec import parse_spec


def _count_builds(monkeypatch) -> list:
    built, real = [], build.build_on_meta

    def counted(*args, **kwargs):
        built.append(args[0].model)
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "build_on_meta", counted)
    return built


def test_tp_auto_builds_once_for_every_degree_it_predicts(monkeypatch):
    built = _count_builds(monkeypatch)
    # a device no degree fits: every T that divides the node's 4 workers is predicted
    spec = parse_spec({"model": "tiny", "seed": 11, "layout": {"tp": "auto"},
                       "dmuon": {"device_memory_gb": 1e-6}})
    plan = plan_document(spec, synthetic_inventory(1, 0, 4), 4)
    reason = plan.modes.reason
    assert all(f"T={t}" in reason for t in (1, 2)), reason  # the degrees weighed
    assert len(built) == 1, built


def test_an_elastic_range_builds_once_for_every_node_count(monkeypatch):
    built = _count_builds(monkeypatch)
    spec = parse_spec({"model": "tiny", "seed": 12, "batch_size": 2, "seq_len": 32,
                       "global_batch_tokens": 12 * 32, "checkpoint": {"interval": 2},
                       "layout": {"elastic": {"min_nodes": 1, "max_nodes": 3},
                                  "workers_per_node": 2}})
    plan = plan_document(spec, synthetic_inventory(3, 0, 2), 2)
    assert [e.layout.nodes for e in plan.elastic] == [1, 2, 3]
    assert len(built) == 1, built


LOCAL = {"model": "tiny", "steps": 1, "seq_len": 16, "batch_size": 1,
         "export": {"enabled": False}}


def _start(rank, world, plan_json: str):
    from service.job.job import Job
    from service.job.plan_document import PlanDocument
    from service.worker.loop import run_training
    from service.worker.mesh import build_mesh

    built, real = [], build.build_on_meta
    build.build_on_meta = lambda *a, **k: built.append(1) or real(*a, **k)
    plan = PlanDocument.model_validate_json(plan_json)  # planned before: not counted
    run_training(Job.local(LOCAL, plan), build_mesh(plan.layout), lambda record, path: None)
    return len(built)


def test_a_worker_builds_once_per_start():
    from service.job.plan.make import plan_on_one_host

    plan = plan_on_one_host(LOCAL, 2)
    assert run(_start, plan.model_dump_json(), world_size=2) == [1, 1]


def test_run_training_takes_at_most_four_parameters():
    from service.worker.loop import run_training

    assert len(inspect.signature(run_training).parameters) <= 4


@pytest.fixture(autouse=True)
def _fresh_plans():
    """plan_document keeps recent plans: each test here plans from scratch."""
    from service.job.plan import make

    make._PLANS.clear()


def test_one_submission_resolves_its_inputs_once_and_builds_once_before_workers(tmp_path):
    """The traced submission (control plane, driver, one worker): the control plane
    resolves the inputs and plans (one build); the driver runs on both, resolving and
    building nothing; the worker builds its own model once."""
    from helpers.job_trace import traced

    calls = traced(tmp_path)["calls"]
    assert calls == {"control:resolve_model": 1, "control:resolve_data": 1,
                     "control:build_on_meta": 1, "worker:build_on_meta": 1}, calls
