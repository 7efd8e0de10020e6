"""The service's pipeline splits (service/job/models/stages.py), one per architecture:
the built-in model, dense and MoE, HF Llama and HF Qwen3-MoE, built from tiny configs
(4 decoder layers). On the meta device, the stages' params and state-dict keys
partition the whole model's, under its FQNs, the embedding on the first stage and the
final norm and head on the last, for 2 and 4 stages; on the CPU in float64 the stages
chained give the whole model's logits; a ``layout.pp`` that does not divide the layers,
a tied head and a model without a split are refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_build import hf_causal_lm

from service.job.models import builtin
from service.job.models.build import logits_of
from service.job.models.stages import check_pp_degree, split_stages

LAYERS = 4
BUILTIN = dict(vocab_size=128, dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2, ffn_dim=64,
               max_seq_len=32)
HF = {"llama": ("LlamaForCausalLM",
                dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=32, use_cache=False)),
      "qwen3_moe": ("Qwen3MoeForCausalLM",
                    dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=16, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                         use_cache=False, tie_word_embeddings=False))}
KINDS = ["builtin", "builtin_moe", "llama", "qwen3_moe"]


def make(kind: str, device=None, **overrides):
    if kind.startswith("builtin"):
        moe = dict(experts=4, top_k=2, moe_ffn_dim=16) if kind == "builtin_moe" else {}
        config = builtin.ModelConfig(**{**BUILTIN, **moe, **overrides})
        return builtin.build_model(config, dtype=torch.float64, device=device or "cpu",
                                   seed=None if device == "meta" else 3)
    name, config = HF[kind]
    model = hf_causal_lm(name, {**config, **overrides}, seed=3, device=device)
    model.config._experts_implementation = "eager"  # the worker's choice for float64
    return model


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_the_stages_partition_the_models_fqns(kind, stages):
    model = make(kind, "meta")
    whole = {n for n, _ in model.named_parameters()}
    parts = [{n for n, _ in s.named_parameters()} for s in split_stages(model, stages)]
    assert sum(len(p) for p in parts) == len(whole) and set().union(*parts) == whole
    keys = [set(s.state_dict()) for s in split_stages(model, stages)]
    assert sum(len(k) for k in keys) == len(model.state_dict())
    assert set().union(*keys) == set(model.state_dict())
    assert "model.embed_tokens.weight" in parts[0]
    assert {"model.norm.weight", "lm_head.weight"} <= parts[-1]
    per = LAYERS // stages
    for i, p in enumerate(parts):
        assert {int(n.split(".")[2]) for n in p if n.startswith("model.layers.")} == \
            set(range(i * per, (i + 1) * per)), (i, sorted(p))
    assert all(p.is_meta for s in split_stages(model, stages) for p in s.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_the_stages_chained_give_the_whole_models_logits(kind):
    model = make(kind)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    h = tokens
    with torch.no_grad():
        whole = logits_of(model, tokens)
        for stage in split_stages(model, 2):
            h = stage(h)
    assert h.shape == whole.shape
    torch.testing.assert_close(h, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_a_pp_that_does_not_divide_the_layers_is_refused_naming_layout_pp(kind):
    model = make(kind, "meta")
    with pytest.raises(ValueError, match=r"layout.pp = 3: 3 stages do not divide the 4 "
                                         r"decoder layers .*; the stage counts that do: "
                                         r"1, 2, 4$"):
        split_stages(model, 3)
    with pytest.raises(ValueError, match=r"layout.pp = 2: 8 stages \(2 x 4\) do not divide"):
        check_pp_degree(model, 8, pp=2)
    check_pp_degree(model, 4, pp=2)


def test_a_tied_head_and_a_model_without_a_split_are_refused():
    tied = make("builtin", "meta", tie_embeddings=True)
    with pytest.raises(ValueError, match="layout.pp = 2: 'lm_head' is tied"):
        split_stages(tied, 2)
    with pytest.raises(ValueError, match="layout.pp = 2: no pipeline split for Linear"):
        check_pp_degree(torch.nn.Linear(2, 2), 2)


@pytest.mark.parametrize("kind", ["builtin", "llama"])
def test_the_stages_hold_the_layer_runs_they_are_given(kind):
    """The stored plan's split (uneven runs here): each stage holds exactly its layers,
    under their FQNs; runs that do not cover the layers in order are refused."""
    model = make(kind, "meta")
    runs = [[0, 1], [1, 4]]
    stages = split_stages(model, 2, layers=runs)
    for stage, (lo, hi) in zip(stages, runs):
        assert stage.layer_range == (lo, hi)
        held = {int(n.split(".")[2]) for n, _ in stage.named_parameters()
                if n.startswith("model.layers.")}
        assert held == set(range(lo, hi))
    assert split_stages(model, 2, layers=[[0, 2], [2, 4]])[1].layer_range == \
        split_stages(model, 2)[1].layer_range == (2, 4)
    for bad in ([[0, 1], [2, 4]], [[0, 2], [2, 3]], [[0, 0], [0, 4]], [[0, 4]]):
        with pytest.raises(ValueError, match="layout.pp"):
            split_stages(model, 2, layers=bad)
