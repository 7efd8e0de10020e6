"""The recipe's pure parts: the LR factor (warmup, cosine, WSD, constant), accumulation
to a global batch in tokens, and the Muon/AdamW split derived for Hugging Face and user
models (with the spec's FQN-regex overrides). No process group."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from helpers.hf_reference import LLAMA, QWEN3_MOE
from helpers.paths import TESTS as HERE

from service.job.models.params import ParamRuleError, split_params
from service.job.plan.layout_choice import batch_split
from service.job.spec import parse_spec
from service.worker.training_recipe import lr_factor


def _spec(**schedule):
    return parse_spec({"steps": 20, "schedule": schedule})


def test_warmup_then_cosine_to_the_minimum():
    spec = _spec(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    assert [lr_factor(spec, s) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    for step in range(4, 20):  # the closed form, written out
        want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 4) / 15))
        assert lr_factor(spec, step) == pytest.approx(want, abs=1e-15)
    assert lr_factor(spec, 4) == 1.0 and lr_factor(spec, 19) == pytest.approx(0.1)


def test_wsd_holds_then_decays_linearly_over_the_last_fraction():
    spec = _spec(warmup_steps=0, decay="wsd", decay_fraction=0.25, min_lr_ratio=0.0)
    assert [lr_factor(spec, s) for s in range(15)] == [1.0] * 15
    assert [lr_factor(spec, s) for s in range(15, 20)] == pytest.approx(
        [0.8, 0.6, 0.4, 0.2, 0.0])
    assert lr_factor(_spec(decay="constant"), 19) == 1.0


def test_accumulation_reaches_the_global_batch_or_names_the_field():
    spec = parse_spec({"batch_size": 2, "seq_len": 16, "global_batch_tokens": 512})
    assert batch_split(spec, 4) == (4, 2)  # 512 / (2 x 16 x 4) micro-batches of 2 rows
    with pytest.raises(ValueError, match="^global_batch_tokens: 512 is not a multiple"):
        batch_split(spec, 3)


def _hf(config):
    import transformers

    cls = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        return cls._from_config(cls.config_class(**config))


def test_hf_llama_split_matrices_of_the_layers_get_muon():
    model = _hf(LLAMA)
    split = split_params(model)
    assert split.boundaries == ["model.layers.0", "model.layers.1"]
    assert set(split.muon) == {n for n, p in model.named_parameters()
                               if n.startswith("model.layers.") and p.ndim == 2}
    assert split.reasons["model.embed_tokens.weight"] == "outside the repeated blocks"
    assert split.reasons["lm_head.weight"] == "outside the repeated blocks"
    assert split.reasons["model.layers.0.input_layernorm.weight"] == "1-D"


def test_qwen3_moe_experts_get_muon_and_the_router_adamw():
    split = split_params(_hf(QWEN3_MOE))
    assert "model.layers.0.mlp.experts.gate_up_proj" in split.muon
    assert "model.layers.1.mlp.experts.down_proj" in split.muon
    assert split.reasons["model.layers.0.mlp.gate.weight"] == "MoE router"


def test_regex_overrides_and_their_refusals_name_the_field():
    model = _hf(LLAMA)
    split = split_params(model, adamw_params=r".*\.q_proj\.weight")
    assert not any("q_proj" in n for n in split.muon)
    assert split.reasons["model.layers.0.self_attn.q_proj.weight"] == "dmuon.adamw_params"
    with pytest.raises(ParamRuleError, match="^dmuon.muon_params: selects"):
        split_params(model, muon_params=r".*norm\.weight")
    with pytest.raises(ParamRuleError, match="^dmuon.hook_boundaries: "):
        split_params(model, hook_boundaries=r"nothing\.here")


def test_a_user_model_with_its_own_names_gets_the_same_rule():
    sys.path.insert(0, os.path.join(HERE, "data", "user_model"))
    try:
        from mymodels.gpt import build
    finally:
        sys.path.pop(0)
    with torch.device("meta"):
        model = build()
    split = split_params(model)
    assert split.boundaries == ["transformer.h.0", "transformer.h.1"]
    assert all(n.startswith("transformer.h.") and n.endswith(".weight") for n in split.muon)
    assert split.reasons["transformer.wpe.weight"] == "outside the repeated blocks"
    with pytest.raises(ParamRuleError, match="^model: no repeated blocks"):
        split_params(torch.nn.Linear(4, 4))
