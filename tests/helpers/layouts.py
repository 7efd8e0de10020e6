"""The layouts of the layout issue's cases (2-D, 3-D, EP), and a submission's plan as the
control plane stores it and as the driver hands it to the workers, for the tests that
follow one ``Layout`` from the planner to the workers."""

from __future__ import annotations

from service.driver import ray_inventory
from service.driver.job_driver import plan_to_run
from service.job.job import Job
from service.job.layout import Layout
from service.job.models.source import BUILTIN
from service.job.plan_document import PlanDocument
from service.job.spec import parse_spec

BASE = {"steps": 1, "seq_len": 16, "batch_size": 1, "export": {"enabled": False}}
# (spec fields, hosts, CPUs per host, the layout expected): each a shape of the issue
CASES = {
    "2-D": ({"model": "tiny", "layout": {"replicate": 2, "shard": 2}}, 2, 2,
            Layout(2, 2, 2, workers_per_node=2, micro_batches=1, rows_per_micro=1)),
    "3-D": ({"model": "tiny", "layout": {"tp": 2}, "global_batch_tokens": 64}, 1, 4,
            Layout(1, 2, 1, tp=2, workers_per_node=4, micro_batches=2, rows_per_micro=1)),
    "EP": ({"model": "small-moe", "layout": {"shard": 4, "ep": 2}}, 1, 4,
           Layout(1, 4, 1, ep=2, workers_per_node=4, micro_batches=1, rows_per_micro=1)),
}


def spec_of(fields: dict):
    return parse_spec({**BASE, **fields})


def stored(plan: PlanDocument) -> PlanDocument:
    """The plan as the control plane stores it and the driver reads it back."""
    return PlanDocument.model_validate_json(plan.model_dump_json())


def handed(spec, plan: PlanDocument, nodes, monkeypatch, tmp_path,
           source=BUILTIN) -> PlanDocument:
    """What the driver hands every worker: the stored plan it checked against the
    cluster Ray reports (here ``nodes``), inside the one ``Job``."""
    monkeypatch.setattr(ray_inventory, "inventory_from_ray", lambda: nodes)
    run = plan_to_run(spec, plan, source)
    return Job.stored(spec, run, None, str(tmp_path)).plan
