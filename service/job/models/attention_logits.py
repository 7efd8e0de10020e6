"""QK-clip's max logits from Hugging Face models: a registered attention function
(transformers' ``AttentionInterface``) that records each head's largest pre-softmax
logit for ``dmuon.qk_clip`` and then runs SDPA as the model would, and the one place
that marks an architecture's attention modules (their ``qk_clip_weights``).

Only attentions whose logits are bilinear in the two projections' rows can be clipped
by scaling those rows (``dmuon.qk_clip``'s rule). Three kinds are refused, naming why:
- per-head q/k norms (Qwen3, Qwen3-MoE, OLMo 2): an RMSNorm after the projection undoes
  any scale of its rows, so the clip would change nothing; the norms' weights are shared
  by every head, so no per-head scale exists there either (the Kimi K2 report, section
  2.1, gives QK-Norm as the other cure, one that MLA cannot use);
- q/k projection biases (Qwen2): ``W x + b`` does not scale with ``W``;
- sliding-window attention: the logits outside the window are masked, and a max over
  the causal matrix would clip heads that never reach tau.
"""

from __future__ import annotations

import torch
from torch import nn

import dmuon.qk_clip

from ..spec.field_types import SpecError

ATTENTION = "dmuon_max_logits"  # the name registered with transformers
_PROJECTIONS = ("q_proj", "k_proj")


def _recording_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask, **kwargs):
    """transformers' SDPA attention, recording the heads' max logits: ``query`` after
    RoPE ``[B, H_q, T, D]``, ``key`` before the GQA repeat ``[B, H_kv, S, D]``. The
    service trains on packed sequences (no padding, ``attention_mask`` None: the causal
    mask SDPA applies); there, without dropout, ``dmuon.qk_clip.attention`` runs it
    (one flex_attention kernel on CUDA for the output and the maxima). A mask given is
    folded into the max-logit pass. A forward without grad (evaluation) records nothing."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    causal = attention_mask is None and getattr(module, "is_causal", True)
    if attention_mask is None and not kwargs.get("dropout"):
        out = dmuon.qk_clip.attention(module, query, key, value, causal=causal,
                                      scale=kwargs.get("scaling"))
        return out.transpose(1, 2).contiguous(), None  # HF's layout: [B, T, H, D]
    dmuon.qk_clip.record_max_logits(module, query, key, causal=causal,
                                    scale=kwargs.get("scaling"),
                                    mask=_attended(attention_mask))
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask,
                                           **kwargs)


def _attended(attention_mask):
    """SDPA's mask as booleans (True = attended): HF's float masks are additive, with
    the dtype's least value on the masked pairs."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if all(isinstance(getattr(m, p, None), nn.Linear) for p in _PROJECTIONS)]


def _refusal(name: str, module: nn.Module) -> str | None:
    """Why QK-clip cannot act on ``module`` by scaling its q/k rows, or None."""
    if any(hasattr(module, n) for n in ("q_norm", "k_norm")):
        return (f"'{name}' normalises q and k per head (q_norm/k_norm): scaling the "
                "projection rows does not change its logits")
    if any(getattr(module, p).bias is not None for p in _PROJECTIONS):
        return f"'{name}' has q/k projection biases: its logits do not scale with the rows"
    if _sliding_window(module):
        return (f"'{name}' attends over a sliding window: a causal max would clip heads "
                "that never reach tau")
    return None


def _sliding_window(module: nn.Module):
    """The window of a sliding-window attention (Mistral names it in its config, Qwen2
    and Gemma on the module), or None."""
    config = getattr(module, "config", None)
    if not getattr(config, "use_sliding_window", True):
        return None
    return getattr(module, "sliding_window", None) or getattr(config, "sliding_window", None)


def enable_qk_clip(model: nn.Module) -> None:
    """Marks a Hugging Face model's attention modules for ``dmuon.Muon(qk_clip=...)``
    and switches it to the recording attention; a SpecError naming ``optimizer.qk_clip``
    for an architecture whose logits the clip cannot bound."""
    from transformers import AttentionInterface

    found = _attention_modules(model)
    if not found:
        raise SpecError(f"optimizer.qk_clip: {type(model).__name__} has no attention "
                        "module with q_proj and k_proj")
    for name, module in found:
        why = _refusal(name, module)
        if why:
            raise SpecError(f"optimizer.qk_clip: {type(model).__name__}: {why}")
        module.qk_clip_weights = tuple(f"{p}.weight" for p in _PROJECTIONS)
    AttentionInterface.register(ATTENTION, _recording_sdpa)
    model.set_attn_implementation(ATTENTION)
