"""The service's MoE models under expert parallelism (``service.job.models.experts``): the
built-in MoE as EP 2 x expert shard 2, as EP 4 and as HSDP 2 x 2 with EP 2, and Hugging
Face's Qwen3-MoE as EP 2, each on 4
gloo ranks in float64, built as the worker builds them (on meta, ``dmuon.shard_experts``
on the experts, ``dedicate_params`` with the service's split and boundaries, FSDP2 per
block, ``materialize``, then ``use_expert_parallel``). Against a single-process
reference of the same model and init (its experts run locally; torch.optim.Muon on each
expert's 2-D slice and on the other matrices, AdamW on the rest), 10 steps, every param
on every rank within 1e-9, Qwen3-MoE also with per-block activation checkpointing (its
forward, token all-to-alls included, re-run in the backward). Each rank holds E/P
experts and the ledger counts the token all-to-alls on ``ep``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.train import (
    HPARAMS,
    global_batches,
    local_rows,
    lr_lambda,
    per_expert_leaves,
    reference_ns,
    step_per_expert,
)

import dmuon
from dmuon.testing import run
from service.job.models.builtin import build_model, init_builtin
from service.job.models.experts import is_expert, use_expert_parallel
from service.job.models.params import split_params
from service.job.spec.presets import ModelConfig

STEPS, SEED = 10, 5
# (replicate R, shard N, EP degree P) per kind: EP 2 x expert shard 2, EP 4 (each rank
# its own 2 experts), HSDP 2 x 2 with EP 2 (the expert shard group one rank a replica)
LAYOUTS = {"builtin": (1, 4, 2), "builtin_ep4": (1, 4, 4), "builtin_hsdp2x2_ep2": (2, 2, 2),
           "qwen3_moe": (1, 4, 2), "qwen3_moe_ac": (1, 4, 2)}
VOCAB, E, K = 64, 8, 2
BUILTIN = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_dim=32, max_seq_len=16, experts=E, top_k=K, moe_ffn_dim=16)
QWEN3_MOE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 32,
             "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "num_experts": E,
             "num_experts_per_tok": K, "norm_topk_prob": True,
             "max_position_embeddings": 64, "model_type": "qwen3_moe"}


def _hf(device=None):
    import transformers

    config = transformers.Qwen3MoeConfig(**QWEN3_MOE)
    config._experts_implementation = "eager"  # the worker's choice for float64
    config.use_cache = False
    with torch.device(device or "cpu"):
        return transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.float64)


def built(kind: str, device=None):
    """The model and its init rule (``device="meta"``: nothing initialised)."""
    if kind.startswith("builtin"):
        model = build_model(BUILTIN, dtype=torch.float64, device=device, seed=SEED)
        return model, init_builtin
    model = _hf(device)  # qwen3_moe, qwen3_moe_ac
    if device != "meta":
        dmuon.init_weights(model, seed=SEED, init_fn=model._init_weights)
    return model, model._init_weights


def loss_of(model, tokens):
    out = model(tokens[:, :-1])
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


@functools.cache
def reference(kind: str) -> dict:
    """One process, the whole batch, each expert's slice a 2-D Muon param of its own."""
    model, _ = built(kind)
    matrices, slices, others = per_expert_leaves(model, split_params(model).predicate)
    h = HPARAMS
    opts = [torch.optim.Muon(matrices + [leaf for *_, leaf in slices], lr=h["lr"],
                             weight_decay=h["weight_decay"], momentum=h["momentum"],
                             nesterov=h["nesterov"]),
            torch.optim.AdamW(others, lr=h["adamw_lr"], betas=h["adamw_betas"],
                              eps=h["adamw_eps"], weight_decay=h["adamw_weight_decay"])]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in opts]
    with reference_ns():
        for batch in global_batches(STEPS, VOCAB):
            loss_of(model, batch).backward()
            step_per_expert(opts, slices)
            for s in scheds:
                s.step()
            model.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _setup(kind: str):
    """The worker's order: meta, experts cut to this EP rank's, dedicated, FSDP2 per
    block and at the root, materialized, then the experts dispatch over the EP group."""
    from torch.distributed.device_mesh import init_device_mesh

    R, N, P = LAYOUTS[kind]
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    model, init_fn = built(kind, device="meta")
    if kind.endswith("_ac"):  # as prepare_on_meta does, before the split
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    split = split_params(model)
    ep_group = dmuon.shard_experts(model, lambda n, p: split.predicate(n, p) and is_expert(n, p),
                                   mesh["shard"], P)
    dmuon.dedicate_params(model, mesh["shard"], split.predicate,
                          hook_boundary_predicate=split.boundary_predicate(model),
                          replicate_mesh=mesh["replicate"] if R > 1 else None,
                          reshard_after_forward=True)
    dp = mesh if R > 1 else mesh["shard"]
    for fqn in split.fsdp_units:
        dmuon.fully_shard(model.get_submodule(fqn), mesh=dp)
    dmuon.fully_shard(model, mesh=dp)
    dmuon.materialize(model, seed=SEED, init_fn=init_fn)
    switched = use_expert_parallel(model, ep_group, dmuon.get_ledger(model))
    return model, split, switched


def _train(rank, world, kind: str):
    model, split, switched = _setup(kind)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for batch in global_batches(STEPS, VOCAB):
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    ledger = dmuon.get_ledger(model)
    local = {n: p.shape[0] for n, p in model.named_parameters() if is_expert(n, p)}
    return {"full": dmuon.full_state_dict(model), "switched": switched, "local": local,
            "boundaries": split.boundaries,
            "ep_bytes": {ph: ledger.last_step("ep", ph)
                         for ph in ("forward", "backward", "recompute")}}


@functools.cache
def trained(kind: str) -> list:
    return run(_train, kind, world_size=4)


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_expert_parallel_training_matches_the_float64_reference(kind):
    ref = reference("builtin" if kind.startswith("builtin") else "qwen3_moe")
    for rank, res in enumerate(trained(kind)):
        assert set(res["full"]) == set(ref)
        for key, value in ref.items():
            err = ((res["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (kind, rank, key, err)


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_each_rank_holds_its_share_of_experts_and_counts_tokens_on_ep(kind):
    for res in trained(kind):
        assert res["switched"] == 2  # one experts module per layer
        assert len(res["local"]) == (6 if kind.startswith("builtin") else 4), res["local"]
        assert set(res["local"].values()) == {E // LAYOUTS[kind][2]}
        assert res["ep_bytes"]["forward"] > 0 and res["ep_bytes"]["backward"] > 0
        # checkpointed, the forward's token exchanges run again in the backward
        assert (res["ep_bytes"]["recompute"] > 0) == kind.endswith("_ac")
        assert [b for b in res["boundaries"] if b.endswith(".mlp.experts")] == \
            [f"model.layers.{i}.mlp.experts" for i in range(2)]


def test_the_local_experts_match_hugging_faces_eager_experts():
    """The grouped evaluation of Hugging Face's fused layout (what ``use_expert_parallel``
    runs at EP 1, and on each rank's experts under EP) matches Hugging Face's own eager
    loop (one process), and the built-in model's experts a per-token loop."""
    model, _ = built("qwen3_moe")
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 32, generator=g, dtype=torch.float64)
    choices = torch.randn(12, E, generator=g).topk(K, dim=-1).indices
    weights = torch.rand(12, K, generator=g, dtype=torch.float64)
    want = experts(x, choices, weights)
    assert use_expert_parallel(model, None) == 2  # one experts module per layer
    got = experts(x, choices, weights)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    builtin = built("builtin")[0].model.layers[0].mlp.experts
    loop = torch.zeros_like(x)
    for t in range(12):
        for j in range(K):
            e = int(choices[t, j])
            h = F.silu(builtin.gate_proj[e] @ x[t]) * (builtin.up_proj[e] @ x[t])
            loop[t] += weights[t, j] * (builtin.down_proj[e] @ h)
    assert torch.allclose(builtin(x, choices, weights), loop, rtol=1e-12, atol=1e-14)


def test_a_spec_names_the_moe_preset_or_its_experts_and_the_counts_match():
    from service.job.spec import SpecError, parse_spec
    from service.job.spec.model_section import builtin_config
    from service.job.spec.presets import num_params

    dims = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 32}
    for model in ("small-moe", {**dims, "experts": 8, "top_k": 2, "moe_ffn_dim": 16},
                  "tiny"):
        config = builtin_config(parse_spec({"model": model}).model)
        meta = build_model(config, device="meta")
        assert num_params(config) == sum(p.numel() for p in meta.parameters()), model
    with pytest.raises(SpecError, match="top_k=3 must lie in"):
        parse_spec({"model": {**dims, "experts": 2, "top_k": 3}})
