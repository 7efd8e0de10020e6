"""QK-clip's max-logit pass on a lent GPU: the per-head max logits that flex_attention
returns with the attention (``dmuon.qk_clip.attention`` on CUDA) against the slab-wise
fallback (``dmuon.qk_clip.max_logits``), values and time, and what each path adds to a
layer's forward.

On CUDA: one Llama-3-8B layer (the built-in model's ``DecoderLayer`` at the
``llama3-8b`` preset: 32 query over 8 key heads, head_dim 128) in bf16 at 8,192 tokens,
batch 1. Rows: the flex path (attention + max scores, one kernel; its max abs diff from
the fallback's maxima on the same q and k) and the fallback (its pass alone, with SDPA's
attention time beside it); each with the layer's forward under grad as the model runs
it, untracked and tracked, and the pass's share of the tracked forward (the pass
alone; for flex, its time over SDPA's on the same q, k, v). ``tiny``: the
``tiny`` preset in float32 on the CPU, the fallback only (the CPU's flex_attention
refuses max scores). Times are medians of ``REPEATS`` after warm-ups (flex's first call
compiles its kernel), ms.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

import dmuon
from service.job.models.builtin import DecoderLayer, get_config, rope_cos_sin

REPEATS = 10


def _ms(fn, device: torch.device) -> float:
    """Median wall time of ``fn`` in ms, the device synchronised around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(REPEATS):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def _fallback_only():
    """``dmuon.qk_clip.attention`` as on a device without flex: SDPA + the slab pass."""
    use = dmuon.qk_clip._use_flex
    dmuon.qk_clip._use_flex = lambda *a: False
    try:
        yield
    finally:
        dmuon.qk_clip._use_flex = use


def _setup(device: torch.device, tiny: bool):
    """(layer, its input and RoPE tables, config, dtype, tokens): weights as the built-in
    model initialises them, the input at unit RMS as after the layer's input norm."""
    c = get_config("tiny" if tiny else "llama3-8b")
    dtype = torch.float32 if tiny else torch.bfloat16
    tokens = c.max_seq_len if tiny else 8192
    torch.manual_seed(0)
    layer = DecoderLayer(c).to(device=device, dtype=dtype)
    for name, p in layer.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, 0.0, 0.02)
    x = torch.randn(1, tokens, c.dim, device=device, dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(tokens, device=device), c.head_dim, c.rope_theta,
                            dtype)
    return layer, (x, cos, sin), c, dtype, tokens


def _qkv(layer, x, cos, sin):
    """The attention's q, k (after RoPE) and v of ``x``, as its forward makes them."""
    from service.job.models.builtin import apply_rope

    a, (b, t, _) = layer.self_attn, x.shape
    q, k, v = (p(x).view(b, t, -1, a.head_dim).transpose(1, 2)
               for p in (a.q_proj, a.k_proj, a.v_proj))
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _layer_forward_ms(layer, inputs, device, tracked: bool) -> float:
    """The layer's forward under grad (the graph dropped), as training runs it."""
    if tracked:
        dmuon.qk_clip.QKClip(layer, dmuon.qk_clip.TAU, {})
    else:
        layer.self_attn.__dict__.pop("_dmuon_max_logits", None)

    def forward():
        layer(*inputs)
    return _ms(forward, device)


def max_logit_rows(device: torch.device, tiny: bool) -> list[dict]:
    """One row per path (flex on CUDA, the fallback everywhere), see the module's doc."""
    device = torch.device("cpu") if tiny else torch.device(device)
    layer, inputs, c, dtype, tokens = _setup(device, tiny)
    with torch.no_grad():
        q, k, v = _qkv(layer, *inputs)
    base = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
            "heads": c.n_heads, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim}
    plain_ms = _layer_forward_ms(layer, inputs, device, tracked=False)
    fallback = dmuon.qk_clip.max_logits(q, k)
    sdpa_ms = _ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         enable_gqa=True), device)
    with _fallback_only():
        tracked_ms = _layer_forward_ms(layer, inputs, device, tracked=True)
    pass_ms = _ms(lambda: dmuon.qk_clip.max_logits(q, k), device)
    rows = [{**base, "path": "fallback", "pass_ms": pass_ms, "attention_ms": sdpa_ms,
             "layer_forward_ms": plain_ms, "tracked_layer_forward_ms": tracked_ms,
             "share": pass_ms / tracked_ms, "max_logit": fallback.max().item(),
             "max_abs_diff": None}]
    if device.type == "cuda" and dmuon.qk_clip._use_flex("cuda", dtype, c.head_dim):
        _, flex = dmuon.qk_clip._flex_attention(q, k, v, True, None)  # compiles
        flex_ms = _ms(lambda: dmuon.qk_clip._flex_attention(q, k, v, True, None), device)
        tracked_ms = _layer_forward_ms(layer, inputs, device, tracked=True)
        rows.append({**base, "path": "flex", "pass_ms": max(flex_ms - sdpa_ms, 0.0),
                     "attention_ms": flex_ms, "layer_forward_ms": plain_ms,
                     "tracked_layer_forward_ms": tracked_ms,
                     "share": max(flex_ms - sdpa_ms, 0.0) / tracked_ms,
                     "max_logit": flex.max().item(),
                     "max_abs_diff": (flex.float() - fallback.float()).abs().max().item()})
    return rows


def table_rows(rows: list[dict]) -> list[tuple[str, str, str, str]]:
    """(check, case, measured, verdict) per path, for ``bench.gpu``'s table."""
    out = []
    for r in rows:
        diff = "" if r["max_abs_diff"] is None else f", max |flex - fallback| " \
            f"{r['max_abs_diff']:.1e}"
        out.append(("QK-clip max logits", f"{r['path']} {r['dtype']} {r['tokens']} tokens",
                    f"pass {r['pass_ms']:.2f} ms (attention {r['attention_ms']:.2f} ms), "
                    f"layer fwd {r['layer_forward_ms']:.2f} -> "
                    f"{r['tracked_layer_forward_ms']:.2f} ms{diff}",
                    f"{100 * r['share']:.1f} % of the tracked forward"))
    return out
