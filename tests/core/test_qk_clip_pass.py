"""QK-clip's max-logit pass (``dmuon.qk_clip``, issue 50 item 2): the maxima it records
against a float64 reference computed here (an einsum over the whole logit matrix, the
mask applied to it), what the fallback writes (counted with a TorchDispatchMode: no
second logit-sized tensor, none at all in slabs, no float32 copy of bf16 q or k), no
record in non-reentrant checkpointing's recompute, and the flex_attention path: chosen
on CUDA only, and its call (block mask, GQA, scale, max scores) checked on the CPU with
the kernel's max scores stood in for, as far as the CPU's flex_attention allows (it
refuses max scores and a backward there)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from helpers.model import build_model, get_config
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dmuon

B, HQ, HKV, T, D = 2, 6, 2, 9, 8  # GQA: 3 query heads per key head


def reference(q, k, scale=None, attended=None):
    """Per query head, the max over batch and attended pairs of q . k * scale, in float64
    from the whole logit matrix (``attended``: SDPA's bool mask, causal if None)."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = torch.einsum("bhtd,bhsd->bhts", q, k) * (scale or q.shape[-1] ** -0.5)
    if attended is None:
        attended = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return logits.masked_fill(~attended, -math.inf).amax(dim=(0, 2, 3))


class Writes(TorchDispatchMode):
    """The tensors each op allocates (outputs sharing no input's storage)."""

    def __init__(self):
        super().__init__()
        self.new = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor)}
        self.new += [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                     and t.untyped_storage().data_ptr() not in given]
        return out


class Attention(nn.Module):
    """A GQA attention through ``dmuon.qk_clip.attention``, counting its forwards."""
    qk_clip_weights = ("q_proj.weight", "k_proj.weight")

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(16, HQ * D, bias=False, dtype=torch.float64)
        self.k_proj = nn.Linear(16, HKV * D, bias=False, dtype=torch.float64)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, HQ, D).transpose(1, 2)
        k = self.k_proj(x).view(b, t, HKV, D).transpose(1, 2)
        self.seen = (q.detach(), k.detach())
        return dmuon.qk_clip.attention(self, q, k, k).transpose(1, 2).reshape(b, t, -1)


def tracked(module):
    dmuon.qk_clip.QKClip(module, 100.0, {})  # tracks its attention modules, as Muon does
    return module


def recorded(module) -> torch.Tensor:
    return module._dmuon_max_logits


def qk(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, T, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, HKV, T, D, dtype=torch.float64, generator=g)
    q[:, :, 0], k[:, :, T - 1] = 10.0, 10.0  # the largest logit is masked: must not count
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("slab", [None, 50])
def test_recorded_max_logits_are_the_float64_reference_written_once(monkeypatch, slab):
    """Whole or in slabs of one query token, the record is the reference's to rounding;
    the pass allocates at most one tensor as large as the heads' logits (the logits, once:
    no masked copy), and none in slabs."""
    if slab:
        monkeypatch.setattr(dmuon.qk_clip, "_SLAB", slab)
    attention = tracked(Attention())
    q, k = qk()
    with Writes() as writes:
        dmuon.qk_clip.record_max_logits(attention, q, k)
    want = reference(q, k)
    assert want.max() < 10.0 * 10.0 * D / math.sqrt(D)  # the masked pair is the largest
    assert torch.allclose(recorded(attention), want, rtol=1e-14, atol=0)
    large = [t.shape for t in writes.new if t.numel() >= HQ * T * T]
    assert len(large) <= (0 if slab else 1), large


def test_bf16_q_and_k_are_read_in_their_own_dtype():
    """No float32 (or wider) copy of q or k; the max is the float64 reference of the same
    bf16 values to the rounding of a bf16 logit (the CPU's matmul writes bf16), kept in
    float32."""
    attention = tracked(Attention())
    q, k = qk(torch.bfloat16)
    with Writes() as writes:
        dmuon.qk_clip.record_max_logits(attention, q, k)
    copies = [t.shape for t in writes.new if t.dtype != torch.bfloat16
              and t.numel() in (q.numel(), k.numel())]
    assert not copies, copies
    got = recorded(attention)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), reference(q, k), rtol=2 ** -8, atol=0)


def test_a_padding_mask_and_a_scale_are_folded_into_the_max():
    g = torch.Generator().manual_seed(1)
    attended = torch.rand(B, 1, T, T, generator=g) < 0.6
    attended[..., 0] = True  # every query attends somewhere
    q, k = qk()
    got = dmuon.qk_clip.max_logits(q, k, causal=False, scale=0.3, mask=attended)
    assert torch.allclose(got, reference(q, k, 0.3, attended), rtol=1e-14, atol=0)


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
def test_the_pass_runs_once_per_forward_not_in_a_recompute(monkeypatch, checkpointing):
    """tests/helpers/model.py's model (``record_max_logits``) and an attention through
    ``dmuon.qk_clip.attention``: one max-logit pass per layer and forward, whatever the
    checkpointing (reentrant's first pass has no grad: its recompute is the one), and the
    record is the unchecked run's."""
    calls = []
    real = dmuon.qk_clip.max_logits
    monkeypatch.setattr(dmuon.qk_clip, "max_logits",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    records = []
    for mode in (None, checkpointing):
        model = tracked(build_model(get_config("tiny"), dtype=torch.float64, seed=0))
        model.model.activation_checkpointing = mode
        calls.clear()
        model(torch.arange(16).view(2, 8)).sum().backward()
        assert len(calls) == model.config.n_layers, (mode, len(calls))
        records.append([recorded(layer.self_attn) for layer in model.model.layers])
    assert all(torch.equal(a, b) for a, b in zip(*records))

    attention = tracked(Attention())
    x = torch.randn(B, T, 16, dtype=torch.float64, requires_grad=True)  # reentrant's need
    calls.clear()
    out = attention(x) if checkpointing is None else torch.utils.checkpoint.checkpoint(
        attention, x, use_reentrant=checkpointing == "reentrant")
    out.sum().backward()
    assert len(calls) == 1 and attention.forwards == (1 if checkpointing is None else 2)
    assert torch.allclose(recorded(attention), reference(*attention.seen), rtol=1e-14)


def test_flex_attention_is_chosen_on_cuda_only():
    use = dmuon.qk_clip._use_flex
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert use("cuda", dtype, 128) and use("cuda", dtype, 64)
        assert not use("cpu", dtype, 128) and not use("meta", dtype, 128)
    assert not use("cuda", torch.float64, 128)  # flex's kernel has no float64
    assert not use("cuda", torch.bfloat16, 8) and not use("cuda", torch.bfloat16, 96)


def test_the_flex_call_gives_the_output_and_records_its_max_scores(monkeypatch):
    """The CPU's flex_attention refuses max scores and a backward: the call is checked
    (a causal block mask, GQA, the scale, max scores asked for), its output computed by
    the real flex_attention without grad against SDPA, and its max scores stood in for
    by the reference's rows, which the record must reduce over batch and queries."""
    from torch.nn.attention import flex_attention as fa

    calls = []

    def flex(q, k, v, **kw):
        calls.append(kw)
        monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)  # eager
        with torch.no_grad():  # the CPU's flex refuses inputs that require grad
            out = fa.flex_attention(q.detach(), k.detach(), v.detach(),
                                    block_mask=kw["block_mask"], scale=kw["scale"],
                                    enable_gqa=kw["enable_gqa"])
        rows = torch.einsum("bhtd,bhsd->bhts", q.detach(), k.detach().repeat_interleave(
            HQ // HKV, dim=1)) * D ** -0.5
        rows = rows.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
        return out, fa.AuxOutput(max_scores=rows.amax(-1).float())

    monkeypatch.setattr(dmuon.qk_clip, "_use_flex", lambda *a: True)
    monkeypatch.setattr(dmuon.qk_clip, "_compiled_flex", lambda: flex)
    attention, x = tracked(Attention()), torch.randn(B, T, 16, dtype=torch.float64)
    out = attention(x)
    (kw,) = calls
    assert kw["return_aux"] == fa.AuxRequest(max_scores=True) and kw["enable_gqa"]
    assert kw["scale"] is None  # flex's default: 1 / sqrt(head_dim), as SDPA's
    dense = fa.create_mask(kw["block_mask"].mask_mod, None, None, T, T, device="cpu")
    assert torch.equal(dense[0, 0], torch.ones(T, T, dtype=torch.bool).tril())
    q, k = attention.seen
    want = F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
    assert torch.allclose(out.detach(), want.transpose(1, 2).reshape(B, T, -1), rtol=1e-12)
    assert torch.allclose(recorded(attention).double(), reference(q, k), rtol=1e-6)
    with torch.no_grad():  # an evaluation wants no max: SDPA, not flex
        attention(x)
    assert len(calls) == 1
