"""One ``Layout`` from the planner to the workers (issue 51): the value ``choose_layout``
makes for a submission is the one the stored plan document holds (after its JSON round
trip, as the store keeps it), the one the driver hands the workers inside the ``Job``
and, in ``test_layout_workers.py``, the one the workers report they ran, field by field:
for a 2-D (HSDP) layout, a 3-D one (tensor parallelism), an expert-parallel one, and
each node count of an elastic range. Old documents (a layout of replicate, shard,
nodes, tp, ep) still load, and a bad layout is refused naming the spec field."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.layouts import CASES, handed, spec_of, stored

from service.job.layout import Layout, PlacementError
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.layout_choice import choose_layout, layout_of
from service.job.plan.make import plan_document
from service.job.plan_document import PlanDocument


@pytest.mark.parametrize("case", CASES)
def test_one_layout_from_choose_layout_to_the_job(case, monkeypatch, tmp_path):
    fields, hosts, cpus, expected = CASES[case]
    spec, nodes = spec_of(fields), synthetic_inventory(hosts, 0, cpus_per_node=cpus)
    chosen = choose_layout(nodes, spec)
    plan = plan_document(spec, nodes, cpus)
    job_plan = handed(spec, stored(plan), nodes, monkeypatch, tmp_path)
    worker = job_plan.for_world(chosen.world_size).layout  # as a worker selects it
    for layout in (plan.layout, stored(plan).layout, job_plan.layout, worker):
        assert isinstance(layout, Layout)
        assert dataclasses.asdict(layout) == dataclasses.asdict(chosen) \
            == dataclasses.asdict(expected)
    assert plan.partition["ep_size"] == chosen.ep  # the partition made for that EP group
    assert plan.scaling.num_workers == chosen.world_size


def test_each_count_of_an_elastic_range_is_one_layout(monkeypatch, tmp_path):
    """An elastic re-plan: each node count's layout, made as the planner makes it, is
    the one the stored plan selects for that many workers (what a restarted worker group
    runs after losing a node)."""
    spec = spec_of({"model": "tiny", "global_batch_tokens": 4 * 16,
                    "checkpoint": {"interval": 1},
                    "layout": {"workers_per_node": 2,
                               "elastic": {"min_nodes": 1, "max_nodes": 2}}})
    nodes = synthetic_inventory(2, 0, cpus_per_node=2)
    job_plan = handed(spec, stored(plan_document(spec, nodes, 2)), nodes, monkeypatch,
                      tmp_path)
    for n, split in ((1, (2, 1)), (2, (1, 1))):
        chosen = layout_of(spec, n, 2, n, 2, 1)
        assert chosen.batch == split and chosen.nodes == n
        assert dataclasses.asdict(job_plan.for_world(2 * n).layout) \
            == dataclasses.asdict(chosen)


def test_a_document_stored_before_the_layout_carried_hosts_and_batch_loads():
    spec = spec_of(CASES["2-D"][0])
    plan = plan_document(spec, synthetic_inventory(2, 0, cpus_per_node=2), 2)
    old = plan.model_dump(mode="json")
    old["layout"] = {"replicate": 2, "shard": 2, "nodes": 2, "tp": 1, "ep": 1}
    loaded = PlanDocument.model_validate(old).layout
    assert loaded == Layout(2, 2, 2, workers_per_node=2)  # the hosts derived
    from service.job.plan.make import with_batch_splits

    assert with_batch_splits(spec, PlanDocument.model_validate(old)).layout == plan.layout
    # the API's readers keep their fields
    assert {"replicate", "shard", "nodes", "tp", "ep"} <= set(plan.model_dump()["layout"])


def test_a_document_stored_with_the_old_names_loads_under_the_new():
    """``param_groups`` (the stored split) and ``completed_by: entrypoint`` were the
    names before 2026-12-05; a stored document keeps loading."""
    plan = plan_document(spec_of(CASES["2-D"][0]), synthetic_inventory(2, 0, cpus_per_node=2), 2)
    new = plan.model_dump(mode="json")
    old = {k: v for k, v in new.items() if k != "optimizer_split"}
    old.update(param_groups=new["optimizer_split"], completed_by="entrypoint")
    loaded = PlanDocument.model_validate(old)
    assert new["optimizer_split"]["muon"] and loaded.optimizer_split == plan.optimizer_split
    assert loaded.completed_by == "driver"
    assert "param_groups" not in loaded.model_dump(mode="json")


@pytest.mark.parametrize("fields,field", [
    ({"replicate": 2, "shard": 3, "nodes": 2, "workers_per_node": 2},
     "layout.shard"),  # 6 workers over 2 hosts of 2
    ({"replicate": 1, "shard": 4, "nodes": 1, "ep": 3}, "layout.ep"),
    ({"replicate": 1, "shard": 1, "nodes": 1, "pp": 2, "micro_batches": 1,
      "rows_per_micro": 1}, "global_batch_tokens"),  # fewer micro-batches than stages
    ({"replicate": 1, "shard": 2, "nodes": 1, "tp": 3, "workers_per_node": 4},
     "layout.tp"),
    ({"replicate": 1, "shard": 2, "nodes": 1, "micro_batches": 2}, "global_batch_tokens"),
])
def test_a_bad_layout_is_refused_naming_the_spec_field(fields, field):
    with pytest.raises(PlacementError) as e:
        Layout(**fields)
    assert e.value.field == field, e.value


def test_a_layout_answers_what_the_mesh_used_to():
    lay = Layout(2, 2, 2, tp=2, workers_per_node=4)
    assert (lay.world_size, lay.dp_size, lay.mesh_dim_names) == (
        8, 4, ("replicate", "shard", "tp"))
    assert lay.tp_enabled and lay.dp_replicate_enabled and not lay.ep_enabled
    assert Layout(1, 4, 1).mesh_dim_names == ("replicate", "shard")
