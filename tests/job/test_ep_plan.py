"""The planner under expert parallelism (``layout.ep``): the EP degree a spec resolves
to, its refusals naming ``layout.ep``, the ``ep`` dim's bytes against a formula written
here, and every prediction against what the workers' own code measures on 4 gloo ranks
(the built-in MoE as EP 2 x expert shard 2, float64, activation checkpointing)."""

from __future__ import annotations

import functools
from fractions import Fraction

import pytest

import dmuon
from service.job.models.source import BUILTIN, ModelSource
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.predict import predict
from service.job.plan_document import partition_digest
from service.job.spec import SpecError, parse_spec

QWEN3_MOE = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
             "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
             "num_experts_per_tok": 2, "max_position_embeddings": 64}
HF = {"hf_arch": "Qwen3MoeForCausalLM", "config": QWEN3_MOE}
F64 = 8


def spec_of(layout: dict, model=None, **extra):
    return parse_spec({"model": model or HF, "precision": "float64", "dmuon": {"mode": "z3"},
                       "batch_size": 2, "seq_len": 16, "layout": layout, **extra})


def cpus(n_nodes=1, per_node=4):
    return synthetic_inventory(n_nodes, 0, cpus_per_node=per_node)


def planned(spec):
    """The planner on 4 CPUs, with the spec's model resolved as a submission does."""
    model = getattr(spec.model, "config", None)
    source = ModelSource(kind="hf", config=model) if model else BUILTIN
    return predict(spec, cpus(), model_source=source)


@pytest.mark.parametrize("layout,ep", [
    ({"replicate": 1, "shard": 4}, 1),  # the default: experts whole
    ({"replicate": 1, "shard": 4, "ep": 2}, 2),
    ({"replicate": 1, "shard": 4, "ep": "auto"}, 4),  # the largest P dividing N and E
    ({"replicate": 2, "shard": 2, "ep": "auto"}, 2),
])
def test_the_ep_degree_is_the_specs_or_the_largest_that_divides(layout, ep):
    placement = planned(spec_of(layout))
    assert placement.plan.ep_size == placement.layout.ep == ep
    experts = [a for a in placement.plan.params.values() if a.ep is not None]
    assert (len(experts) > 0) == (ep > 1)
    # each expert slice is owned by a rank of its EP coordinate: shard index mod P
    assert all(a.owner_coord[1] % ep == a.ep for a in experts)


@pytest.mark.parametrize("model,layout,says", [
    (HF, {"replicate": 1, "shard": 4, "ep": 3}, "does not divide the shard size"),
    (dict(HF, config={**QWEN3_MOE, "num_experts": 6}), {"replicate": 1, "shard": 4, "ep": 4},
     "does not divide the model's 6 experts"),
    ("tiny", {"replicate": 1, "shard": 4, "ep": 2}, "has no MoE experts"),
])
def test_an_ep_the_model_or_mesh_cannot_take_is_refused_naming_layout_ep(model, layout, says):
    with pytest.raises(SpecError, match=says) as e:
        planned(spec_of(layout, model))
    assert str(e.value).startswith("layout.ep")


def _ep_formula(layers, experts, top_k, hidden, tokens, micros, P, checkpointing):
    """Per rank and step, by the ledger's all-to-all model ((P-1)/P of what a rank puts
    in) with routing spread evenly: forward the E int64 counts, the n*k rows out and as
    many back; backward their two gradients; a checkpointed forward again."""
    rows = tokens * top_k * hidden * F64
    forward = layers * micros * Fraction(P - 1, P) * (8 * experts + 2 * rows)
    out = {"forward": forward, "backward": layers * micros * Fraction(P - 1, P) * 2 * rows}
    return {**out, "recompute": forward} if checkpointing else out


@pytest.mark.parametrize("checkpointing", ["none", "non_reentrant"])
def test_the_ep_bytes_are_the_formula(checkpointing):
    spec = spec_of({"replicate": 1, "shard": 4, "ep": 2}, global_batch_tokens=256,
                   activation_checkpointing=checkpointing)
    placement = planned(spec)
    micros, rows = 2, 2  # 256 tokens = 4 ranks x 2 micro-batches x 2 rows x 16
    want = _ep_formula(2, 8, 2, 32, rows * 16, micros, 2, checkpointing != "none")
    for rank in placement.ranks:
        assert {k: Fraction(v) for k, v in rank.ledger["ep"].items()} == want, rank.rank
    assert "ep" not in planned(spec_of({"replicate": 1, "shard": 4})).ranks[0].ledger


def test_the_experts_packed_buffer_holds_e_over_p_experts():
    """Each rank gathers only its EP coordinate's E/P experts, so the packed peak falls
    with P while the Muon elements owned over all ranks stay the model's."""
    placements = {P: planned(spec_of({"replicate": 1, "shard": 4, "ep": P}))
                  for P in (1, 2, 4)}
    owned = {P: sum(r.owned_elements for r in p.ranks) for P, p in placements.items()}
    assert owned[1] == owned[2] == owned[4]
    peak = {P: max(r.packed_peak for r in p.ranks) for P, p in placements.items()}
    assert peak[1] > peak[2] > peak[4], peak
    expert_layer = 8 * 3 * 16 * 32 * F64  # E x (gate_up 2I + down I) x hidden
    assert peak[1] - peak[2] >= expert_layer // 2 - expert_layer // 4, peak


def _measure(rank, world, spec_data):
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.models.build import logits_of
    from service.job.models.builtin import causal_lm_loss, vocab_parallel
    from service.worker.corpus import batch_at, load_corpus
    from service.worker.loop import build_training

    spec = parse_spec(spec_data)
    N, T = spec.layout.shard, spec.layout.tp
    mesh = init_device_mesh("cpu", (1, N, T), mesh_dim_names=("replicate", "shard", "tp"))
    model, opt, _ = build_training(spec, mesh if T > 1 else mesh["replicate", "shard"])
    corpus = load_corpus("train", max_bytes=200_000)
    s = mesh["shard"].get_local_rank()  # a TP group's ranks share their rows
    ledgers = []
    for step in range(2):
        rows = batch_at(corpus, step, spec.batch_size * N, spec.seq_len)
        rows = rows[s * spec.batch_size:(s + 1) * spec.batch_size]
        with vocab_parallel(T):
            causal_lm_loss(logits_of(model, rows[:, :-1]), rows[:, 1:]).backward()
        dmuon.clip_grad_norm_(model, spec.clip_grad_norm)
        opt.step()
        opt.zero_grad()
        ledgers.append(dmuon.get_ledger(model).last_step_by_phase())
    return dmuon.memory_report(model, opt), ledgers, dmuon.get_plan(model).to_dict()


# EP 2 x expert shard 2; and under TP, attention split over 2 TP ranks and the experts
# whole on each, EP 2 over the 2 shard ranks
LAYOUTS = {"1x4_ep2": {"replicate": 1, "shard": 4, "ep": 2},
           "1x2x2_ep2": {"replicate": 1, "shard": 2, "tp": 2, "ep": 2}}


@functools.cache
def measured_ep2(layout_id: str):
    from dmuon.testing import run

    data = {"model": "small-moe", "precision": "float64", "dmuon": {"mode": "z3"},
            "activation_checkpointing": "non_reentrant", "clip_grad_norm": 1.0,
            "layout": LAYOUTS[layout_id], "batch_size": 2, "seq_len": 16}
    return predict(parse_spec(data), cpus(1, 4)), run(_measure, data, world_size=4)


@pytest.mark.parametrize("layout_id", sorted(LAYOUTS))
def test_predictions_equal_what_an_ep2_run_of_the_workers_measures(layout_id):
    """Memory and the shard/replicate/tp bytes per rank exactly; the ``ep`` bytes summed over
    the ranks at every step (what a rank receives depends on the routing, what all ranks
    receive is what they all sent)."""
    placement, results = measured_ep2(layout_id)
    for rank, (memory, ledgers, _) in enumerate(results):
        assert memory == placement.ranks[rank].memory, rank
        for ledger in ledgers:
            for dim in ("shard", "replicate", "tp"):
                assert ledger.get(dim, {}) == placement.ranks[rank].ledger.get(dim, {}), rank
    for step in range(2):
        for phase in ("forward", "backward", "recompute"):
            got = sum(r[1][step]["ep"][phase] for r in results)
            want = sum(Fraction(p.ledger["ep"][phase]) for p in placement.ranks)
            assert got == want, (step, phase)


@pytest.mark.parametrize("layout_id", sorted(LAYOUTS))
def test_the_workers_run_the_stored_ep_partition(layout_id):
    placement, results = measured_ep2(layout_id)
    stored = placement.plan.to_dict()
    assert stored["ep_size"] == 2
    for _, _, run_plan in results:
        assert partition_digest(run_plan) == partition_digest(stored)
        assert run_plan == stored


def test_a_deferred_plan_and_an_elastic_range_carry_the_ep_degree():
    """A plan the job's entrypoint completes (the control plane cannot build the model)
    keeps the spec's P in its layout; an elastic range's every node count too, equal to
    its partition's."""
    from service.job.plan.elastic import elastic_document
    from service.job.plan.layout_choice import choose_layout
    from service.job.plan.make import deferred_document

    assumed = {"source": "assumed", "nodes": 1, "cpus_per_node": 4, "reason": "no cluster"}
    for ep in (1, 2):
        spec = spec_of({"replicate": 1, "shard": 4, "ep": ep})
        layout = choose_layout(cpus(), spec)
        assert deferred_document(spec, layout, assumed, "x").layout.ep == ep
    spec = parse_spec({"model": "small-moe", "global_batch_tokens": 256, "seq_len": 16,
                       "batch_size": 2, "checkpoint": {"interval": 2},
                       "layout": {"workers_per_node": 2, "ep": 2,
                                  "elastic": {"min_nodes": 1, "max_nodes": 2}}})
    plan = elastic_document(spec, cpus(1, 2)[0], {"source": "assumed", "nodes": 2})
    assert plan.layout.ep == 2 and plan.partition["ep_size"] == 2
    for entry in plan.runnable():
        assert entry.layout.ep == entry.partition["ep_size"] == 2, entry.layout


def test_hook_boundaries_mixing_experts_with_dense_params_are_refused_under_ep():
    """A whole decoder layer as one boundary holds its experts and its attention: EP lays
    them out apart, so the spec is refused naming the field (EP 1 takes it)."""
    whole_layers = {"hook_boundaries": r"model\.layers\.\d+", "mode": "z3"}
    with pytest.raises(SpecError, match="'model.layers.0' holds MoE experts") as e:
        planned(spec_of({"replicate": 1, "shard": 4, "ep": 2}, dmuon=whole_layers))
    assert str(e.value).startswith("dmuon.hook_boundaries")
    assert planned(spec_of({"replicate": 1, "shard": 4}, dmuon=whole_layers)).plan.ep_size == 1


def test_mfu_counts_the_top_k_experts_a_token_runs():
    """small-moe by hand: per layer norms 2 x 128, q/o 128 x 128, k/v 64 x 128, router
    128 x 8, and of its 8 experts (3 x 128 x 128 each) the 2 a token runs; the final norm
    and the head (256 x 128); the embedding not. The same on a model cut to EP 2."""
    import torch

    from service.job.models.builtin import build_model
    from service.worker.step_metrics import flops_per_token

    model = build_model("small-moe", dtype=torch.float32, device="meta")
    layer = 2 * 128 + 2 * 128 * 128 + 2 * 64 * 128 + 128 * 8 + 2 * 3 * 128 * 128
    params = 2 * layer + 128 + 256 * 128
    assert flops_per_token(model, 2, 128, 16) == 6 * params + 12 * 2 * 128 * 16
    for block in model.model.layers:  # what dmuon.shard_experts leaves a rank of EP 2
        experts = block.mlp.experts
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(experts, name, torch.nn.Parameter(getattr(experts, name)[:4]))
    assert flops_per_token(model, 2, 128, 16) == 6 * params + 12 * 2 * 128 * 16
