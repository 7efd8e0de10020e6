"""An elastic job's spec and plan (``layout.elastic``), no process group: the fields it
needs and refuses (each naming its field), the per-node-count table the planner makes
(one replica per node, the fixed global batch split on every layout, a layout whose
rank is over its memory refused and the range Ray Train gets narrowed to what runs),
the worker's pick by world size, and that every layout's ranks read the same global
batch of every step, row for row."""

from __future__ import annotations

import pytest
import torch

import dmuon
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.make import plan_document
from service.job.spec import SpecError, parse_spec
from service.worker.batches import Batches
from service.worker.loop import BUILTIN_INPUTS

BASE = {"model": "tiny", "steps": 8, "batch_size": 2, "seq_len": 32,
        "global_batch_tokens": 12 * 32, "checkpoint": {"interval": 2},
        "layout": {"elastic": {"min_nodes": 1, "max_nodes": 5}, "workers_per_node": 2}}


def _plan(spec_data, nodes=3, cpus=2):
    return plan_document(parse_spec(spec_data), synthetic_inventory(nodes, 0, cpus), 4)


@pytest.mark.parametrize("change,says", [
    ({"layout": {"elastic": {"min_nodes": 4, "max_nodes": 3}}},
     "layout.elastic: .*min_nodes=4 exceeds max_nodes=3"),
    ({"layout": {"nodes": 2, "elastic": {"max_nodes": 3}}},
     "layout.nodes cannot be set with layout.elastic"),
    ({"layout": {"replicate": 2, "elastic": {"max_nodes": 3}}},
     "layout.replicate cannot be set with layout.elastic"),
    ({"global_batch_tokens": None}, "layout.elastic needs global_batch_tokens"),
    ({"global_batch_tokens": 100}, "global_batch_tokens=100 is not a whole number of "
                                   "sequences of seq_len=32"),
    ({"checkpoint": {"interval": 0}}, "layout.elastic needs checkpoint.interval > 0"),
    ({"layout": {"elastic": {"max_nodes": 2000}}}, "layout.elastic.max_nodes"),
    ({"layout": {"elastic": {"max_nodes": 2, "resize_check_s": float("nan")}}},
     "layout.elastic.resize_check_s"),
    ({"layout": {"elastic": {"max_nodes": 2, "max_wait_s": 0}}}, "layout.elastic.max_wait_s"),
    ({"layout": {"elastic": {"max_nodes": 2, "max_wait_s": float("inf")}}},
     "layout.elastic.max_wait_s"),
    ({"layout": {"elastic": {"max_nodes": 2, "max_wait_s": 10**30}}},
     "layout.elastic.max_wait_s"),
])
def test_bad_elastic_specs_are_refused_naming_the_field(change, says):
    with pytest.raises(SpecError, match=says):
        parse_spec({**BASE, **change})


def test_each_node_count_splits_the_same_global_batch_or_says_why_not():
    plan = _plan(BASE)
    assert [e.layout.nodes for e in plan.elastic] == [1, 2, 3, 4, 5]
    for e in plan.elastic:
        assert (e.layout.replicate, e.layout.shard) == (e.layout.nodes, 2)  # R per node
        dp = e.layout.world_size
        if 12 % dp:  # 12 sequences per step: 8 and 10 ranks cannot share them evenly
            assert e.refused == (f"global_batch_tokens: 12 sequences per step cannot be "
                                 f"split evenly over {dp} data-parallel ranks")
            assert e.partition is None and e.ranks == []
            continue
        assert e.refused is None and e.micro_batches * e.rows_per_micro * dp == 12
        assert e.rows_per_micro <= 2 and (12 // dp) % e.rows_per_micro == 0
        assert len(e.ranks) == dp and len(e.partition["params"]) > 0
        owners = {a["owner"] for a in e.partition["params"].values()}
        assert owners <= set(range(dp)) and e.partition["shard_size"] == 2
    by_nodes = {e.layout.nodes: e for e in plan.elastic}
    assert (by_nodes[2].micro_batches, by_nodes[2].rows_per_micro) == (3, 1)  # 3 rows each
    assert (by_nodes[3].micro_batches, by_nodes[3].rows_per_micro) == (1, 2)
    # the plan's own layout is the largest that runs; Ray Train gets the runnable range
    assert (plan.layout.replicate, plan.layout.shard) == (3, 2)
    assert plan.partition == by_nodes[3].partition
    assert plan.scaling.config_kwargs()["num_workers"] == (2, 6)
    assert plan.scaling.config_kwargs()["elastic_resize_monitor_interval_s"] == 60.0


def test_the_worker_takes_the_layout_planned_for_its_world_size():
    plan = _plan(BASE)
    four = plan.for_world(4)
    assert (four.layout.replicate, four.layout.shard, four.layout.nodes) == (2, 2, 2)
    assert four.partition == plan.elastic[1].partition and len(four.ranks) == 4
    with pytest.raises(ValueError, match="Ray Train started 8 workers; the plan has "
                                         "layouts for 2, 4, 6 workers"):
        plan.for_world(8)


def test_a_layout_over_its_memory_is_refused_and_the_range_starts_above_it():
    # 1.95 MB per worker, 90% of it usable: a rank of one node (1 x 2) holds more of the
    # tiny model than a rank of two (2 x 2), which fits
    spec = {**BASE, "dmuon": {"device_memory_gb": 0.00195}}
    plan = _plan(spec)
    held = {}
    for e in plan.elastic[:3]:
        held[e.layout.nodes] = e.modes.z3_bytes if e.modes.dmuon == "z3" else e.modes.z2_bytes
    assert held[1] > 0.9 * 1.95e6 >= held[2] >= held[3]  # the planner's own figures
    assert plan.elastic[0].refused == (f"a rank would hold {held[1] / 1e6:.2f} MB in Z3, "
                                       "over the 1.75 MB usable of its 1.95 MB")
    assert [e.layout.world_size for e in plan.runnable()] == [4, 6]
    assert plan.scaling.config_kwargs()["num_workers"] == (4, 6)


def test_a_range_with_no_runnable_node_count_is_refused_with_each_reason():
    spec = {**BASE, "global_batch_tokens": 7 * 32,
            "layout": {"elastic": {"min_nodes": 1, "max_nodes": 2}, "workers_per_node": 2}}
    with pytest.raises(SpecError, match=r"^layout.elastic: no node count in the range can "
                                        r"run: 1 node\(s\): global_batch_tokens: 7 "
                                        r"sequences .* 2 data-parallel ranks; 2 node\(s\)"):
        _plan(spec)


def test_a_count_that_cannot_run_between_two_that_can_is_refused():
    """20 sequences: 2, 4 and 10 ranks split them, 6 and 8 do not; Ray Train could start
    a group of 6 or 8 inside the range (2, 10), so the range is refused."""
    with pytest.raises(SpecError, match=r"^layout.elastic: 3, 4 node\(s\) lie between "
                                        r"runnable counts 1 and 5 but cannot run "
                                        r"\(global_batch_tokens: 20 sequences per step "
                                        r"cannot be split evenly over 6 data-parallel"):
        _plan({**BASE, "global_batch_tokens": 20 * 32})
    # a count that cannot run above the largest that can only lowers Ray Train's maximum
    assert _plan(BASE).scaling.config_kwargs()["num_workers"] == (2, 6)


def test_every_layout_reads_the_same_rows_of_each_step():
    """The global batch of a step, gathered over every rank and micro-batch in the order
    of its global row index, is the same tensor on every runnable layout."""
    plan = _plan(BASE)
    batches = Batches(BUILTIN_INPUTS["data"], "train", 32, 0, 0.05)
    for step in (0, 5):
        seen = []
        for e in plan.runnable():
            dp, micros, per = e.layout.world_size, e.micro_batches, e.rows_per_micro
            parts = {(m * dp + r) * per: batches.rows(step, per, r, dp, m, micros)
                     for m in range(micros) for r in range(dp)}
            seen.append(torch.cat([parts[k] for k in sorted(parts)]))
        assert len(seen) == 3 and all(torch.equal(s, seen[0]) for s in seen)
        assert seen[0].shape == (12, 33)


def test_the_tables_partitions_are_dmuons_for_each_layout():
    """Each entry's partition is ``dmuon.partition`` of the model on that layout (the
    call the workers would make without a plan), owner for owner."""
    from service.job.models.build import prepare_on_meta
    from service.job.models.source import BUILTIN

    spec = parse_spec(BASE)
    prepared = prepare_on_meta(spec, BUILTIN, torch.float32)
    for e in _plan(BASE).runnable():
        want = dmuon.partition(prepared.model, predicate=prepared.split.predicate,
                               shard_size=e.layout.shard, replicate_size=e.layout.replicate,
                               hook_boundary_predicate=prepared.split.boundary_predicate(
                                   prepared.model))
        got = dmuon.DedicationPlan.from_dict(e.partition)
        assert got.to_dict() == want.to_dict()
        assert len(want.elements_per_rank) == e.layout.world_size


NODES = [  # ray.nodes() entries: a CPU-less head, two GPU hosts (one dead), a CPU host
    {"NodeID": "h", "Alive": True, "Resources": {"node:__internal_head__": 1.0,
                                                 "memory": 1e9, "object_store_memory": 1e9}},
    {"NodeID": "g1", "Alive": True, "Resources": {"CPU": 16.0, "GPU": 8.0, "memory": 1e12}},
    {"NodeID": "g2", "Alive": False, "Resources": {"CPU": 16.0, "GPU": 8.0}},
    {"NodeID": "g3", "Alive": True, "Resources": {"CPU": 5.0, "GPU": 8.0}},
    {"NodeID": "c1", "Alive": True, "Resources": {"CPU": 7.0, "memory": 1e10}},
]


@pytest.mark.parametrize("resources,use_gpu,max_workers", [
    ({"CPU": 1.0}, False, 64), ({"CPU": 2.0, "GPU": 0.0}, False, 64),
    ({"CPU": 1.0}, True, 64), ({"CPU": 1.0, "GPU": 1.0}, True, 10),
    ({"CPU": 0.5, "GPU": 2.0}, True, 64)])
def test_the_workers_counted_between_steps_are_the_ones_ray_train_would_start(
        resources, use_gpu, max_workers):
    """The elastic job's own count (service.worker.capacity) against Ray Train's: its
    coordinator's node filter and its elastic policy's count, run on the same nodes."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as rc
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy

    from service.job.plan_document import Scaling
    from service.worker.capacity import worker_resources, workers_on

    scaling = Scaling(num_workers=max_workers, use_gpu=use_gpu, resources_per_worker=resources,
                      placement_strategy="PACK", min_workers=1)
    coordinator = rc._AutoscalingCoordinatorActor(
        send_resources_request=lambda *a: None, get_cluster_nodes=lambda: NODES)
    reserved = coordinator._cluster_node_resources[rc.DEFAULT_SUBCLUSTER]
    policy = ElasticScalingPolicy(ScalingConfig(**scaling.config_kwargs()))
    want = policy._count_possible_workers(reserved)
    assert workers_on(NODES, worker_resources(scaling), max_workers) == want
