"""The service's models take QK-clip's max logits from the attention kernel where the
device allows (``dmuon.qk_clip.attention``: one flex_attention call on CUDA): the
built-in model and HF Llama through the recording attention, with flex_attention
selected as on CUDA and stood in for on the CPU (which refuses its max scores and a
backward) by SDPA plus the float64 row maxima of the q and k it was given. Checked: one
call per layer and training forward, none without tracking or grad, the output the same
as the plain model's, and the record the reduction of those rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_build import hf_causal_lm

import dmuon
from service.job.models.attention_logits import enable_qk_clip
from service.job.models.builtin import build_model

HF_CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 use_cache=False)


@pytest.fixture
def flex(monkeypatch):
    """Calls to the stand-in flex_attention: (q, k, its keywords); per query row, the
    max of q . k * scale over the causal keys in float64, as the kernel's max scores."""
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest

    calls = []

    def stand_in(q, k, v, *, block_mask, scale, enable_gqa, return_aux):
        assert return_aux == AuxRequest(max_scores=True) and block_mask is not None
        calls.append((q.detach(), k.detach()))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=enable_gqa)
        return out, AuxOutput(max_scores=row_maxima(q.detach(), k.detach(), scale))

    monkeypatch.setattr(dmuon.qk_clip, "_use_flex", lambda *a: True)
    monkeypatch.setattr(dmuon.qk_clip, "_compiled_flex", lambda: stand_in)
    return calls


def row_maxima(q, k, scale=None):
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = torch.einsum("bhtd,bhsd->bhts", q, k) * (scale or q.shape[-1] ** -0.5)
    t = q.shape[2]
    return logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf).amax(-1)


def records(layers) -> list[torch.Tensor]:
    return [layer.self_attn._dmuon_max_logits for layer in layers]


def check_records(layers, calls):
    for got, (q, k) in zip(records(layers), calls, strict=True):
        assert torch.allclose(got.double(), row_maxima(q, k).amax(dim=(0, 2)), rtol=1e-12)


def test_the_builtin_model_takes_the_max_logits_from_flex_attention(flex):
    plain = build_model("tiny", dtype=torch.float64, seed=0)
    model = build_model("tiny", dtype=torch.float64, seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = plain(tokens)
    dmuon.qk_clip.QKClip(plain, 100.0, {})
    with torch.no_grad():
        plain(tokens)  # tracked, but an evaluation: SDPA
    assert not flex
    dmuon.qk_clip.QKClip(model, 100.0, {})
    got = model(tokens)
    assert len(flex) == model.config.n_layers
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    check_records(model.model.layers, flex)
    model.model.activation_checkpointing = "non_reentrant"
    flex.clear()
    dmuon.qk_clip.QKClip(model, 100.0, {})
    model(tokens).sum().backward()  # the recompute runs flex too, and records nothing
    assert len(flex) == 2 * model.config.n_layers
    check_records(model.model.layers, flex[:model.config.n_layers])


def test_hf_llama_takes_the_max_logits_from_flex_attention(flex):
    plain = hf_causal_lm("LlamaForCausalLM", HF_CONFIG, seed=5)
    model = hf_causal_lm("LlamaForCausalLM", HF_CONFIG, seed=5)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    enable_qk_clip(model)
    dmuon.qk_clip.QKClip(model, 100.0, {})
    got = model(input_ids=tokens).logits
    assert len(flex) == HF_CONFIG["num_hidden_layers"]
    with torch.no_grad():
        want = plain(input_ids=tokens).logits
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)  # HF's [B, T, H, D] layout
    check_records(model.model.layers, flex)


def test_the_gpu_bench_rows_run_tiny_on_the_cpu_with_the_fallback_only():
    """``bench.gpu_qk_clip`` as the suite runs it: one fallback row, whose max logit is
    the float64 reference's on the layer's own q and k."""
    from bench.gpu_qk_clip import _qkv, _setup, max_logit_rows, table_rows

    (row,) = max_logit_rows(torch.device("cpu"), tiny=True)
    assert row["path"] == "fallback" and row["max_abs_diff"] is None
    assert row["pass_ms"] > 0 and 0 < row["share"] and row["tokens"] == 64
    layer, inputs, *_ = _setup(torch.device("cpu"), tiny=True)
    with torch.no_grad():
        q, k, _ = _qkv(layer, *inputs)
    assert math.isclose(row["max_logit"], row_maxima(q, k).max().item(), rel_tol=1e-5)
    assert len(table_rows([row])) == 1
