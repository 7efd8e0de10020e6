"""The planner under pipeline parallelism (``layout.pp``): the bubble formulas, the stage
split (every layer once, in order, the embedding first and the head last, the slowest
stage least, checked by exhaustive search), must-show 6 (with the optimizer step in
the split a head-heavy model's slowest stage is faster than with layers split by count,
both figures computed here from the units), the refusals naming their field, the API
(plan yes, submission no) and the CLI's stages."""

from __future__ import annotations

import itertools
import os

import pytest

from service.job.layout import Layout, PlacementError
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.make import plan_document
from service.job.plan.stage_split import Costs, Unit, best_split, bubble, count_split, in_flight
from service.job.spec import SpecError, parse_spec

ADMIN = "admin-token"


@pytest.mark.parametrize("pp,m,v", [(2, 2, 1), (4, 8, 1), (8, 32, 1), (16, 256, 1),
                                    (4, 8, 2), (8, 16, 4)])
def test_the_bubble_is_the_schedules_idle_share(pp, m, v):
    # 1F1B and GPipe: pp-1 idle slots of m+pp-1; interleaved: stages v times as short
    assert bubble("1f1b", pp, m) == bubble("gpipe", pp, m) == (pp - 1) / (m + pp - 1)
    assert bubble("interleaved", pp, m, v) == (pp - 1) / (v * m + pp - 1)
    # 1F1B holds at most pp micro-batches on its first stage, GPipe all m
    assert [in_flight("1f1b", pp, m, k) for k in range(pp)] == [
        min(m, pp - k) for k in range(pp)]
    assert in_flight("gpipe", pp, m, 0) == m


def _stage_seconds(units, head, embed, lo, hi, *, tokens, owners, tp=1, ns=True):
    """A stage's seconds written out here: 3 x forward FLOPs per token x tokens / T at
    400 TFLOP/s (the head's too, the embedding's 0), plus the NS FLOPs at its busiest
    owner: the stage's over the owners, at least its largest matrix, over T."""
    rate, n = 400e12, len(units)
    fwd = sum(u.fwd_flops for u in units[lo:hi]) + (head.fwd_flops if hi == n else 0) \
        + (embed.fwd_flops if lo == 0 else 0)
    t = 3 * fwd * tokens / tp / rate
    if ns:
        total = sum(u.ns_flops for u in units[lo:hi])
        t += max(total / owners, max(u.ns_largest for u in units[lo:hi])) / tp / rate
    return t


def _all_splits(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        yield list(zip(b, b[1:]))


def _layers(n, seed):
    import random

    rnd = random.Random(seed)
    return [Unit(rnd.uniform(1e9, 4e9), rnd.randrange(10**12, 10**13), 10**11, 10**6, 10**3)
            for _ in range(n)]


@pytest.mark.parametrize("n,k,seed", [(7, 3, 0), (9, 4, 1), (6, 6, 2), (10, 2, 3)])
def test_the_split_covers_every_layer_once_in_order_and_its_slowest_stage_is_least(n, k, seed):
    layers = _layers(n, seed)
    embed, head = Unit(0.0, 0, 0, 0, 10**6), Unit(5e9, 0, 0, 0, 10**6)
    costs = Costs(embed, layers, head, tokens=4096, owners=8)
    split = best_split(costs, k)
    assert len(split) == k and split[0][0] == 0 and split[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(split, split[1:]))  # contiguous
    assert all(lo < hi for lo, hi in split)  # every stage a layer at least
    assert sorted(i for lo, hi in split for i in range(lo, hi)) == list(range(n))

    def worst(s):
        return max(_stage_seconds(layers, head, embed, lo, hi, tokens=4096, owners=8)
                   for lo, hi in s)
    # the planner's stage cost is the one written above; its split the exhaustive best
    assert all(costs(lo, hi) == pytest.approx(_stage_seconds(
        layers, head, embed, lo, hi, tokens=4096, owners=8)) for lo, hi in split)
    assert worst(split) == pytest.approx(min(worst(s) for s in _all_splits(n, k)))
    assert count_split(n, k) == [(lo, hi) for lo, hi in count_split(n, k)]
    sizes = [hi - lo for lo, hi in count_split(n, k)]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


def test_must_show_6_the_step_in_the_split_beats_the_split_by_count():
    """A head-heavy model: 8 equal layers of a 4096-wide model (12 x 4096^2 matmul
    weights, NS of four 4096 x 4096 and two 4096 x 11008 matrices at 5 steps of
    FLOPs 5 x (2mnm + 2m^3 + 2m^2n)), a 256k x 4096 head; 4 stages, 8 owners each."""
    def ns(m, n):
        m, n = sorted((m, n))
        return 5 * (2 * m * n * m + 2 * m ** 3 + 2 * m * m * n)
    d, f, V = 4096, 11008, 256_000
    layer_ns = 4 * ns(d, d) + 3 * ns(d, f)
    layer = Unit(2.0 * (4 * d * d + 3 * d * f) + 2 * 8192 * d, layer_ns, ns(d, f),
                 4 * d * d + 3 * d * f, 2 * d)
    layers, embed, head = [layer] * 8, Unit(0.0, 0, 0, 0, V * d), Unit(2.0 * V * d, 0, 0, 0, V * d)
    tokens, owners = 8 * 8192, 8
    planner = best_split(Costs(embed, layers, head, tokens=tokens, owners=owners), 4)

    def worst(split, ns=True):
        return max(_stage_seconds(layers, head, embed, lo, hi, tokens=tokens, owners=owners,
                                  ns=ns) for lo, hi in split)
    by_count = [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert count_split(8, 4) == by_count
    exhaustive = min(worst(s) for s in _all_splits(8, 4))
    assert worst(planner) == pytest.approx(exhaustive)
    assert worst(planner) < worst(by_count)  # the head's stage gets fewer layers
    assert planner[-1][1] - planner[-1][0] < 2
    print(f"slowest stage: split with the step {worst(planner):.4f} s, "
          f"by count {worst(by_count):.4f} s")


def _spec(layout: dict, **extra):
    return {"model": "tiny", "batch_size": 2, "global_batch_tokens": 2 * 64 * 4 * 2,
            "layout": layout, "resources_per_worker": {"CPU": 1, "GPU": 1}, **extra}


def test_a_zero_bubble_schedule_is_refused_naming_the_field_and_why():
    with pytest.raises(SpecError) as e:
        parse_spec(_spec({"pp": 2, "pp_schedule": "ZBV"}))
    assert e.value.fields[0].startswith("spec.layout.pp_schedule:"), e.value.fields
    assert "zero-bubble" in str(e.value) and "full backward" in str(e.value)
    with pytest.raises(SpecError) as e:
        parse_spec(_spec({"pp": 2, "pp_schedule": "1f1b", "pp_stages_per_rank": 2}))
    assert "layout.pp_stages_per_rank" in str(e.value)
    assert parse_spec(_spec({"pp": 2, "pp_schedule": "interleaved"})) \
        .layout.stages_per_rank == 2


def test_more_stages_than_layers_and_too_few_micro_batches_are_refused():
    nodes = synthetic_inventory(2, 4)
    with pytest.raises(PlacementError) as e:  # tiny has 2 layers
        plan_document(parse_spec(_spec({"pp": 4, "nodes": 2}, global_batch_tokens=2 * 64 * 2 * 4)),
                      nodes, 4)
    assert e.value.field == "layout.pp", e.value
    assert "4 stages do not divide the 2 decoder layers" in str(e.value)
    with pytest.raises(PlacementError) as e:  # 1 micro-batch per step, 2 stages
        plan_document(parse_spec(_spec({"pp": 2, "nodes": 2}, global_batch_tokens=2 * 64 * 4,
                                       resources_per_worker={"CPU": 1})), nodes, 4)
    assert e.value.field == "global_batch_tokens", e.value
    with pytest.raises(PlacementError) as e:
        Layout(1, 4, 2, pp=2, micro_batches=1, rows_per_micro=2)
    assert e.value.field == "global_batch_tokens"


def test_a_pipeline_layout_orders_pp_outermost_and_names_each_ranks_stage():
    lay = Layout(2, 4, 4, tp=2, pp=2, workers_per_node=8, micro_batches=4, rows_per_micro=1)
    assert lay.world_size == 2 * 2 * 4 * 2
    assert lay.mesh_dim_names == ("pp", "replicate", "shard", "tp")
    assert lay.mesh_shape == (2, 2, 4, 2)
    assert [lay.stage_of(r) for r in (0, 15, 16, 31)] == [0, 0, 1, 1]
    spec = parse_spec(_spec({"pp": 2, "nodes": 2}))
    doc = plan_document(spec, synthetic_inventory(2, 4), 4)
    pipe = doc.pipeline
    assert doc.layout.pp == 2 and doc.layout.world_size == 8
    assert [r["ranks"] for r in pipe["ranks"]] == [[0, 3], [4, 7]]
    assert [s["layers"] for s in pipe["stages"]] == [[0, 1], [1, 2]]
    assert pipe["stages"][0]["embedding"] and pipe["stages"][-1]["head"]
    assert all(s["ns_flops_per_owner"] > 0 for s in pipe["stages"])
    # one host per stage: the boundary crosses InfiniBand; m x rows x seq x dim x bf16
    assert pipe["stages"][0]["link_next"] == "infiniband"
    # 1024 tokens over 4 data-parallel ranks of 2 rows of 64: 2 micro-batches
    assert doc.layout.micro_batches == 2
    elt = {"float32": 4, "bfloat16": 2}[spec.precision.compute]
    assert pipe["ranks"][0]["pp_bytes"] == {"forward": 2 * 2 * 64 * 64 * elt, "backward": 0}
    assert pipe["ranks"][1]["pp_bytes"] == {"forward": 0, "backward": 2 * 2 * 64 * 64 * elt}
    assert pipe["bubble"] == (2 - 1) / (2 + 2 - 1)


def test_the_api_accepts_a_pipeline_and_refuses_what_workers_cannot_run(tmp_path):
    """A job with layout.pp: 2 is accepted (dry run and real) with the stage split in its
    stored plan, and one with TP 2 inside its stages; what the workers cannot run is a
    422 naming the field: stages that do not divide the layers (spec.layout.pp), fewer
    micro-batches than stages (the field that sets them: spec.global_batch_tokens), an
    elastic range (spec.layout.pp), TP inside the stages over a sequence it does not cut
    evenly (spec.seq_len)."""
    from fastapi.testclient import TestClient

    from service.control.app import create_app
    from service.control.settings import Settings

    settings = Settings(api_token=ADMIN, db=os.path.join(tmp_path, "dmuon.db"),
                        storage=str(tmp_path))
    spec = _spec({"pp": 2, "nodes": 1, "workers_per_node": 2},
                 global_batch_tokens=2 * 64 * 1 * 2, resources_per_worker={"CPU": 1})
    auth = {"Authorization": f"Bearer {ADMIN}"}
    refusals = [
        ({"pp": 4, "nodes": 1, "workers_per_node": 4}, {}, "spec.layout.pp",
         "4 stages do not divide the 2 decoder layers"),
        ({"pp": 2, "nodes": 1, "workers_per_node": 2}, {"global_batch_tokens": 2 * 64},
         "spec.global_batch_tokens", "1 micro-batches per step, fewer than layout.pp=2"),
        ({"pp": 2, "elastic": {"min_nodes": 1, "max_nodes": 2}}, {}, "spec.layout.pp",
         "cannot be set with layout.elastic"),
        ({"pp": 2, "tp": 2, "nodes": 1, "workers_per_node": 4},
         {"seq_len": 63, "global_batch_tokens": 2 * 63 * 4}, "spec.seq_len",
         "tp must divide seq_len"),
    ]
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as client:
        planned = client.post("/v1/plan", json=spec, headers=auth)
        assert planned.status_code == 200, planned.text
        assert [s["pp_rank"] for s in planned.json()["pipeline"]["stages"]] == [0, 1]
        for body in ({"spec": spec}, {"spec": spec, "dry_run": True}):
            accepted = client.post("/v1/jobs", json=body, headers=auth)
            assert accepted.status_code == 201, accepted.text
            stored = client.get(f"/v1/jobs/{accepted.json()['id']}/partition", headers=auth)
            assert stored.status_code == 200, stored.text
            assert stored.json()["pipeline"] == planned.json()["pipeline"]
        tp = {"spec": _spec({"pp": 2, "tp": 2, "nodes": 1, "workers_per_node": 4},
                            resources_per_worker={"CPU": 1}), "dry_run": True}
        accepted = client.post("/v1/jobs", json=tp, headers=auth)  # TP inside the stages
        assert accepted.status_code == 201, accepted.text
        stored = client.get(f"/v1/jobs/{accepted.json()['id']}/partition", headers=auth)
        assert (stored.json()["layout"]["pp"], stored.json()["layout"]["tp"]) == (2, 2)
        for layout, extra, field, message in refusals:
            body = {"spec": {**_spec(layout, resources_per_worker={"CPU": 1}), **extra},
                    "dry_run": True}
            refused = client.post("/v1/jobs", json=body, headers=auth)
            assert refused.status_code == 422, refused.text
            (error,) = refused.json()["detail"]
            assert error["field"] == field, error
            assert message in error["message"], error


def test_the_cli_plan_with_pp_prints_each_stage(capsys):
    from service.job.plan.__main__ import main

    assert main(["--model", "tiny", "--nodes", "2", "--gpus-per-node", "4", "--pp", "2",
                 "--seq-len", "64", "--micro-batches", "4"]) == 0
    out = capsys.readouterr().out
    assert "pp 2 x 1 x 4 x 1" in out and "bubble 0.200" in out  # (2-1)/(4+2-1)
    assert "emb + 0-0" in out and "1-1 + head" in out and "NS TFLOP/owner" in out


# 4 layers of a 512-wide model, a 32k head: its logits weigh next to its states
SMALL = {"vocab_size": 32000, "dim": 512, "n_layers": 4, "n_heads": 8, "n_kv_heads": 8,
         "ffn_dim": 1408, "max_seq_len": 1024}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_at_pp_1_the_pipeline_estimate_is_predicts(tp):
    """``choose_pp`` weighs pp > 1 (the pipeline's estimate) against pp 1 (``predict``'s,
    checked against measurement): at pp 1 the two agree. The activations exactly: one
    micro-batch's layers, one recomputed block and the logits, 1/T of them under TP (the
    head keeps them vocabulary shards). The whole within 1%, never above ``predict``: the
    pipeline counts each stage's states as an even share over its ranks (and the norms
    1/T) where ``predict`` takes the worst rank of dmuon's partition (norms whole)."""
    from service.job.plan.modes import activation_bytes
    from service.job.plan.pipeline_plan import pipeline_placement
    from service.job.plan.predict import MetaModel, needed_bytes, predict

    spec = parse_spec({
        "model": SMALL, "batch_size": 1, "seq_len": 1024, "global_batch_tokens": 16 * 1024,
        "activation_checkpointing": "non_reentrant", "dmuon": {"mode": "z3"},
        "precision": {"master_dtype": "float32", "param_dtype": "bfloat16",
                      "reduce_dtype": "float32"},
        "layout": {"nodes": 2, "replicate": 1, "shard": 8 // tp, "tp": tp, "pp": 1},
        "resources_per_worker": {"CPU": 1, "GPU": 1}})
    nodes, meta = synthetic_inventory(2, 4), MetaModel(spec, None)
    _, plan = pipeline_placement(spec, nodes, meta, 1, projection=True)
    (rank,) = plan.ranks
    assert rank["memory"]["activations"] == activation_bytes(
        tokens=1024, hidden=512, layers=4, vocab=32000, elt=2, checkpointed=True, tp=tp,
        logits_split=tp)
    expected = needed_bytes(predict(spec, nodes, model_source=meta).modes)
    assert 0 <= expected - rank["peak_bytes"] <= 0.01 * expected, (rank["peak_bytes"], expected)


def test_micro_batches_waiting_for_backward_keep_only_their_blocks_inputs():
    """Under checkpointing, 1F1B's pp rank 0 of 4 holds 4 micro-batches' activations:
    the one in backward with its recomputed block (``activation_bytes``), the 3 waiting
    with their blocks' inputs alone (rows x seq x hidden x 2 bytes per layer, written
    out here): a block is recomputed in its own micro-batch's backward, one at a time."""
    from service.job.plan.modes import activation_bytes
    from service.job.plan.pipeline_plan import pipeline_placement
    from service.job.plan.predict import MetaModel

    spec = parse_spec({
        "model": SMALL, "batch_size": 1, "seq_len": 1024, "global_batch_tokens": 16 * 1024,
        "activation_checkpointing": "non_reentrant", "dmuon": {"mode": "z3"},
        "precision": {"master_dtype": "float32", "param_dtype": "bfloat16",
                      "reduce_dtype": "float32"},
        "layout": {"nodes": 2, "replicate": 1, "shard": 2, "pp": 4},
        "resources_per_worker": {"CPU": 1, "GPU": 1}})
    _, plan = pipeline_placement(spec, synthetic_inventory(2, 4), MetaModel(spec, None), 4)
    first = plan.ranks[0]
    assert first["in_flight"] == 4 and plan.stages[0]["layers"] == [0, 1]
    one = activation_bytes(tokens=1024, hidden=512, layers=1, vocab=0, elt=2,
                           checkpointed=True)
    assert first["memory"]["activations"] == one + 3 * 1 * 1024 * 512 * 2
