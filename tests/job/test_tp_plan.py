"""The planner under tensor parallelism (``layout.tp``): R x N x T layouts and their
refusals, each rank's memory and ``tp`` bytes against formulas written here from the
torchtitan layout ``service.job.models.tp_plans`` applies (and against what a 2 x 1 x 2 run of the
workers measures), ``tp: auto``, the elastic range at a fixed T, and stored documents
from before tensor parallelism."""

from __future__ import annotations

import functools

import pytest
import torch

import dmuon
from service.job.plan.elastic import elastic_document
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.layout_choice import PlacementError, check_fits
from service.job.plan.predict import predict
from service.job.plan_document import Layout, PlanDocument, partition_digest
from service.job.spec import SpecError, parse_spec

# the tiny preset: vocabulary 256, hidden 64, 2 blocks, 4 heads and 2 KV heads of 16
V, H, LAYERS, KV, FFN = 256, 64, 2, 32, 128
SHAPES = {"q_proj": (H, H), "k_proj": (KV, H), "v_proj": (KV, H), "o_proj": (H, H),
          "gate_proj": (FFN, H), "up_proj": (FFN, H), "down_proj": (H, FFN)}
ROWWISE = ("o_proj", "down_proj")
F64 = 8


def tiny(layout: dict, **extra):
    return parse_spec({"model": "tiny", "precision": "float64", "dmuon": {"mode": "z3"},
                       "batch_size": 2, "seq_len": 16, "layout": layout, **extra})


def cpus(n_nodes=1, per_node=4):
    return synthetic_inventory(n_nodes, 0, cpus_per_node=per_node)


def _partition(R: int, N: int) -> dict:
    """dmuon's partition of the tiny model on global shapes (as for T = 1)."""
    from service.job.models.build import prepare_on_meta
    from service.job.models.source import BUILTIN

    prepared = prepare_on_meta(tiny({}), BUILTIN, torch.float64)
    split = prepared.split
    return dmuon.partition(prepared.model, predicate=split.predicate, shard_size=N,
                           replicate_size=R).to_dict()["params"]


@pytest.mark.parametrize("change,says", [
    ({"layout": {"tp": 0}}, "layout.tp"),
    ({"layout": {"tp": "most"}}, "layout.tp"),
    ({"layout": {"tp": 2}, "model": {"hf_arch": "LlamaForCausalLM", "config": {},
                                     "weights": "ckpt"}},
     "layout.tp=2 with model.weights"),
])
def test_bad_tp_specs_are_refused_naming_the_field(change, says):
    with pytest.raises(SpecError, match=says):
        parse_spec({"model": "tiny", **change})


def test_layouts_put_tp_groups_inside_a_node_and_scale_to_r_n_t():
    p = predict(tiny({"tp": 2}), cpus(2, 4))
    assert (p.layout.replicate, p.layout.shard, p.layout.tp, p.world_size) == (2, 2, 2, 8)
    assert p.scaling_config_kwargs()["num_workers"] == 8
    assert [r.coord for r in p.ranks[:5]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                              (1, 0, 0)]
    one = predict(tiny({}), cpus(2, 4))
    assert one.ranks[0].coord == (0, 0) and "tp" not in one.ranks[0].ledger
    assert "(r,s,t)" in p.table() and "tp GB/step" in p.table()
    assert "(r,s,t)" not in one.table() and "tp GB/step" not in one.table()
    assert p.table().startswith("layout 2 x 2 x 2 (replicate x shard x tp) on 2 nodes")


@pytest.mark.parametrize("layout,nodes,reason", [
    ({"tp": 4, "workers_per_node": 2}, 1, r"layout.tp=4 must divide the 2 workers per node"),
    ({"tp": 3}, 1, r"layout.tp=3 must divide the 4 workers per node"),
    ({"replicate": 3, "shard": 1, "tp": 2}, 1, r"3 x 1 x 2 = 6 workers cannot be split"),
])
def test_layouts_tp_cannot_make_are_refused_naming_layout_tp(layout, nodes, reason):
    with pytest.raises(PlacementError, match=reason) as refused:
        predict(tiny(layout), cpus(nodes, 4))
    assert refused.value.field == "layout.tp"  # the 422's spec.layout.tp


def test_a_degree_the_model_cannot_split_is_refused_naming_the_module():
    spec = parse_spec({"model": {"dim": 96, "n_layers": 1, "n_heads": 12, "n_kv_heads": 4,
                                 "ffn_dim": 192}, "layout": {"tp": 3, "workers_per_node": 3}})
    with pytest.raises(SpecError, match=r"^layout.tp: tp = 3 does not divide the 4 KV heads "
                                        r"of 'model.layers.0.self_attn.k_proj'"):
        predict(spec, cpus(1, 3))


def test_check_fits_counts_the_tp_ranks():
    spec = tiny({"tp": 2})
    layout = Layout(replicate=1, shard=2, nodes=1, tp=2)
    check_fits(layout, spec, cpus(1, 4))
    with pytest.raises(PlacementError, match=r"stored plan \(1 x 2 x 2 on 1 node\(s\), 4 "
                                             r"workers"):
        check_fits(layout, spec, cpus(1, 3))


def _fsdp(rows: int, rest: int, n: int) -> int:
    """FSDP2's padded shard of a [rows, rest] param on n ranks, in float64."""
    return -(-rows // n) * rest * F64


def test_each_rank_holds_its_tp_shards_share():
    R, N, T = 1, 2, 2
    placement = predict(tiny({"replicate": R, "shard": N, "tp": T}), cpus(1, 4))
    owners = _partition(R, N)
    norms = 2 * LAYERS + 1
    for rank in placement.ranks:
        r, s, t = rank.coord
        slot = r * N + s
        owned = sum(a["numel"] for a in owners.values() if a["owner"] == slot)
        column = sum(a["numel"] for a in owners.values() if a["owner_coord"][1] == s)
        # every Muon matrix is split by T; embedding rows and the head's vocabulary rows
        # too (then FSDP2 pads and shards the TP shard's rows), the norms stay whole
        assert rank.memory == {
            "packed_buffers": 0, "owned_params": column // T * F64,
            "momentum": owned // T * F64,
            "fsdp_shards": 2 * _fsdp(V // T, H, N) + norms * _fsdp(H, 1, N),
            "adamw_state": 2 * F64 * (2 * (V // T // N) * H + norms * (H // N))}
        assert rank.owned_elements == owned // T


def _gram_bytes(owned: list[str], T: int, elt: int) -> float:
    """Per owned matrix: split along its longer (or equal) dim, two all-reduces (Gram NS
    restarts once) of the m x m Gram matrix, m the unsplit dim; along its shorter (k/v,
    colwise with fewer rows than columns), one all-gather of the whole matrix."""
    total = 0.0
    for fqn in owned:
        rows, cols = SHAPES[fqn.split(".")[-2]]
        split = 1 if fqn.split(".")[-2] in ROWWISE else 0
        split_len, other = (rows, cols)[split], (rows, cols)[1 - split]
        total += 2 * 2 * (T - 1) / T * other * other * elt if split_len >= other \
            else (T - 1) / T * rows * cols * elt
    return total


def _activation_bytes(rows: int, seq: int, T: int, recompute_per_block: int) -> dict:
    """Per micro-batch, torchtitan's sequence-parallel layout on [rows, seq, width]
    float64 activations ((T-1)/T of each tensor per all-gather or reduce-scatter):
    forward, per block the attention's and the MLP's inputs all-gathered and o_proj's and
    down_proj's outputs reduce-scattered, the embedding's output reduce-scattered, the
    head's input all-gathered (its logits stay sharded on the vocabulary: no gather);
    backward the reverse of each; checkpointing runs a block's forward collectives
    again."""
    f = (T - 1) / T
    S = rows * seq * H * F64
    out = {"forward": f * (LAYERS * 4 * S + 2 * S),
           "backward": f * (LAYERS * 4 * S + 2 * S)}
    if recompute_per_block:
        out["recompute"] = f * LAYERS * recompute_per_block * S
    return out


@pytest.mark.parametrize("checkpointing,recomputed", [
    ("none", 0), ("non_reentrant", 3),  # early stop: down_proj's reduce-scatter is not
    ("reentrant", 4)])
def test_tp_bytes_are_the_activation_collectives_and_gram_all_reduces(checkpointing,
                                                                       recomputed):
    R, N, T, micros = 2, 1, 2, 3
    spec = tiny({"replicate": R, "shard": N, "tp": T}, activation_checkpointing=checkpointing,
                global_batch_tokens=micros * 2 * 16 * R * N)
    placement = predict(spec, cpus(1, 4))
    owners = _partition(R, N)
    for rank in placement.ranks:
        slot = rank.rank // T
        tp = dict(rank.ledger["tp"])
        clip = 2 * (T - 1) / T * 2 * F64  # clip_grad_norm_'s two squares
        # the step's fp32 flags: per unit, per DP rank, FSDP2's, then one after NS
        flags = 2 * (T - 1) / T * (len(owners) + R * N + 2) * 4
        owned = [u for u, a in owners.items() if a["owner"] == slot]
        assert tp.pop("step") == pytest.approx(_gram_bytes(owned, T, F64) + clip + flags,
                                               rel=1e-12)
        expected = {k: micros * v for k, v in _activation_bytes(2, 16, T, recomputed).items()}
        assert tp == pytest.approx(expected, rel=1e-12)
        seconds = sum(sum(p.values()) / bw for p, bw in (
            (rank.ledger["tp"], 450e9), (rank.ledger["replicate"], 50e9),
            (rank.ledger["shard"], 5e9)))
        assert rank.comm_seconds == pytest.approx(seconds, rel=1e-12)


def _measure(rank, world, spec_data):
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.models.build import logits_of
    from service.job.models.builtin import causal_lm_loss, vocab_parallel
    from service.worker.corpus import batch_at, load_corpus
    from service.worker.loop import build_training

    spec = parse_spec(spec_data)
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model, opt, _ = build_training(spec, mesh)
    corpus = load_corpus("train", max_bytes=200_000)
    dp = mesh["replicate"].get_local_rank()
    for step in range(2):
        rows = batch_at(corpus, step, spec.batch_size * 2, spec.seq_len)
        rows = rows[dp * spec.batch_size:(dp + 1) * spec.batch_size]
        with vocab_parallel(2):
            causal_lm_loss(logits_of(model, rows[:, :-1]), rows[:, 1:]).backward()
        dmuon.clip_grad_norm_(model, spec.clip_grad_norm)
        opt.step()
        opt.zero_grad()
    return (dmuon.memory_report(model, opt), dmuon.get_ledger(model).last_step_by_phase(),
            dmuon.get_plan(model).to_dict())


@functools.cache
def measured_2x1x2():
    from dmuon.testing import run

    data = {"model": "tiny", "precision": "float64", "dmuon": {"mode": "z3"},
            "activation_checkpointing": "non_reentrant", "clip_grad_norm": 1.0,
            "layout": {"replicate": 2, "shard": 1, "tp": 2}, "batch_size": 2, "seq_len": 16}
    return predict(parse_spec(data), cpus(1, 4)), run(_measure, data)


def test_predictions_equal_what_a_2x1x2_run_of_the_workers_measures():
    placement, results = measured_2x1x2()
    for rank, (memory, ledger, _) in enumerate(results):
        assert memory == placement.ranks[rank].memory, rank
        assert ledger == placement.ranks[rank].ledger, rank


def test_the_stored_partition_is_the_one_the_workers_run():
    placement, results = measured_2x1x2()
    stored = placement.plan.to_dict()
    assert stored["tp_size"] == 2
    for _, _, run_plan in results:
        assert partition_digest(run_plan) == partition_digest(stored)
        assert run_plan == stored  # owners, global shapes, each matrix's NS rule over TP


def test_tp_auto_takes_the_smallest_degree_the_global_batch_splits_on():
    # 2 sequences of 16 per step: 4 data-parallel ranks (T = 1) cannot share them
    spec = tiny({"tp": "auto"}, global_batch_tokens=2 * 16 * 2)
    p = predict(spec, cpus(1, 4))
    assert (p.layout.replicate, p.layout.shard, p.layout.tp) == (1, 2, 2)
    assert "layout.tp: auto chose T=2" in p.modes.reason and "T=1: global_batch_tokens" \
        in p.modes.reason


def test_tp_auto_over_an_elastic_range_is_the_same_search():
    # 2 sequences of 16 per step on 1 or 2 nodes of 4: T = 1 (4 and 8 data-parallel
    # ranks) runs no count of the range; T = 2 runs 1 node (2 ranks), not 2 (4 ranks)
    spec = tiny({"tp": "auto", "elastic": {"min_nodes": 1, "max_nodes": 2}},
                global_batch_tokens=2 * 16, checkpoint={"interval": 1})
    plan = elastic_document(spec, cpus(1, 4)[0], {"source": "assumed", "nodes": 1})
    assert [(e.layout.replicate, e.layout.shard, e.layout.tp) for e in plan.elastic] == [
        (1, 2, 2), (2, 2, 2)]
    assert [e.refused is None for e in plan.elastic] == [True, False]


def test_tp_auto_takes_the_smallest_degree_that_fits_memory():
    def spec(tp):
        return parse_spec({"model": "llama3-8b", "seq_len": 8192, "batch_size": 1,
                           "activation_checkpointing": "non_reentrant",
                           "dmuon": {"mode": "auto", "device_memory_gb": 30.0},
                           "layout": {"tp": tp},
                           "resources_per_worker": {"CPU": 1, "GPU": 1}})
    nodes = synthetic_inventory(1, 8)
    fits = {T: predict(spec(T), nodes).modes.fits for T in (1, 2, 4, 8)}
    smallest = min(T for T, ok in fits.items() if ok)
    assert smallest > 1, fits  # the case this test is about: DP alone does not fit
    chosen = predict(spec("auto"), nodes)
    assert chosen.layout.tp == smallest and chosen.modes.fits


def test_the_elastic_range_keeps_t_and_varies_r():
    spec = tiny({"tp": 2, "elastic": {"min_nodes": 1, "max_nodes": 3}},
                global_batch_tokens=12 * 16, checkpoint={"interval": 1})
    plan = elastic_document(spec, cpus(1, 4)[0], {"source": "assumed", "nodes": 1})
    assert [(e.layout.replicate, e.layout.shard, e.layout.tp) for e in plan.elastic] == [
        (1, 2, 2), (2, 2, 2), (3, 2, 2)]
    assert [e.micro_batches * e.rows_per_micro * e.layout.dp_size for e in plan.elastic] \
        == [12, 12, 12]  # the same sequences per step on every count
    assert all(len(e.ranks) == e.layout.world_size and len(e.ranks[0].coord) == 3
               for e in plan.elastic)
    assert (plan.scaling.num_workers, plan.scaling.min_workers) == (12, 4)
    assert plan.for_world(8).layout == Layout(replicate=2, shard=2, nodes=2, tp=2,
                                              micro_batches=3, rows_per_micro=1)


def test_a_document_stored_before_tp_still_loads():
    old = {"layout": {"replicate": 2, "shard": 2, "nodes": 1},
           "inventory": {"source": "assumed", "nodes": 1, "cpus_per_node": 4},
           "scaling": {"num_workers": 4, "use_gpu": False, "resources_per_worker": {"CPU": 1},
                       "placement_strategy": "PACK"},
           "ranks": [{"rank": 0, "coord": [0, 0], "owned_elements": 1, "ns_flops": 1,
                      "memory": {}, "packed_peak": 0, "ledger": {}, "comm_seconds": 0.0}]}
    doc = PlanDocument.model_validate(old)
    assert doc.layout == Layout(replicate=2, shard=2, nodes=1, tp=1)
    assert doc.layout.world_size == 4 and doc.for_world(4) is doc
