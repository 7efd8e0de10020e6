"""QK-clip (MuonClip): attention heads whose largest pre-softmax logit of the step went
over ``tau`` get their query and key projection rows scaled down after the step, at the
owner of each projection matrix, before the post-step broadcast carries them.

The rule is the Kimi K2 technical report's (arXiv 2507.20534, section 2.1, "MuonClip"):
``S_h`` is head h's max logit over the step's batch, ``gamma_h = min(1, tau / S_h)``,
and both ``W_q^h`` and ``W_k^h`` are multiplied by ``sqrt(gamma_h)``; tau = 100 is the
report's (Kimi K2 trained with it). Logits are bilinear in the two projections (RoPE
rotates q and k, a linear map per position), so the head's logits all scale by
``gamma_h`` and its max ends at ``min(S_h, tau)``.

GQA: a key head is shared by its group of query heads, so it cannot take each head's
own ``sqrt(gamma_h)``. We scale the key head by ``sqrt(gamma_g)`` with ``gamma_g =
min(1, tau / max_{h in g} S_h)`` (the group's worst head), and each query head by
``gamma_h / sqrt(gamma_g)``: every head's logits scale by exactly ``gamma_h`` (clipped
heads end at tau, the others are unchanged), the group's worst head splits its
correction evenly as in the report, and a group of one head (MHA) is the report's rule.
The report's own answer for a shared key (MLA's shared rotary key ``k_R``, left alone
while ``q_R`` takes the whole ``gamma_h``) would not scale k at all and put all of it on
q; the even split keeps q and k norms balanced, which is why the report splits it.

A model's attention module takes part by naming its projection weights in the attribute
``qk_clip_weights`` (``("q_proj.weight", "k_proj.weight")``, paths under the module, rows
ordered head by head, query head h in key group ``h // (H_q / H_kv)``) and calling
``record_max_logits(self, q, k)`` in its forward with q and k as softmax sees them
(after RoPE, ``[batch, heads, tokens, head_dim]``, k before any GQA repeat), or by
running its attention through ``attention(self, q, k, v)``, which on CUDA takes the
maxima from the flex_attention kernel itself (no second pass over the logits) and
elsewhere runs SDPA after ``max_logits``, a slab-wise pass that reads q and k in their
own dtype. The maxima are rank-local and kept as a running max over the step's
micro-batches; non-reentrant checkpointing's recompute is not recorded (its forward
was), forwards without grad (evaluation) are not either, and ``zero_grad`` drops the
maxima with the gradients.
Under TP each rank records its own (colwise) heads; the maxima are reduced with MAX over
the data-parallel groups only.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import comm

TAU = 100.0  # Kimi K2 technical report, section 2.1
WEIGHTS_ATTR = "qk_clip_weights"
_MAX_ATTR = "_dmuon_max_logits"  # present (None or the running max) while tracked
_SLAB = 2 ** 26  # logits per slab of query tokens (256 MB in fp32): long sequences fit


def is_tracking(attention) -> bool:
    """Whether ``attention``'s max logits are wanted (a ``dmuon.Muon(qk_clip=...)`` exists)."""
    return hasattr(attention, _MAX_ATTR)


def max_logits(q: torch.Tensor, k: torch.Tensor, *, causal: bool = True,
               scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per query head, the largest of ``q . k * scale`` (default ``1/sqrt(head_dim)``,
    > 0) over batch and attended token pairs: ``causal`` masks key s after query t as
    SDPA's ``is_causal`` does (top-left aligned), ``mask`` (bool, True = attended,
    broadcastable to ``[B, H_q, T, S]``) as SDPA's ``attn_mask``. The fallback of the
    flex kernel (``attention``): q and k are read in their own dtype, slab by slab of
    query tokens (at most ``_SLAB`` logits each), a causal slab only up to its last
    query's key, the mask folded in place; the max is kept in float32 at least."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    if not scale > 0:  # the max is scaled after the reduction, which a sign would flip
        raise ValueError(f"dmuon.qk_clip.max_logits: scale must be > 0, got {scale}")
    hidden = None if mask is None else ~mask.expand(b, hq, t, s).unflatten(1, (hkv, -1))
    grouped = q.unflatten(1, (hkv, hq // hkv))  # a view: GQA without repeating k
    keys = k.reshape(b * hkv, s, d)  # a view unless k is strided oddly (one copy then)
    out = torch.full((hkv, hq // hkv), -math.inf, device=q.device,
                     dtype=torch.promote_types(q.dtype, torch.float32))
    per_slab = max(1, _SLAB // (b * hq * s))
    for start in range(0, t, per_slab):
        stop = min(t, start + per_slab)
        logits = _slab_logits(grouped, keys, start, stop, min(s, stop) if causal else s)
        if causal:  # keys before the slab's first query are all attended: only the
            # diagonal block has masked pairs
            diagonal = logits[..., start:stop]
            later = torch.ones(stop - start, diagonal.shape[-1], dtype=torch.bool,
                               device=q.device).triu(1)
            diagonal.masked_fill_(later, -math.inf)
        if hidden is not None:
            logits.masked_fill_(hidden[..., start:stop, :logits.shape[-1]], -math.inf)
        out = torch.maximum(out, logits.amax(dim=(0, 3, 4)).to(out.dtype))
    return out.reshape(hq) * scale


def _slab_logits(grouped, keys, start: int, stop: int, width: int) -> torch.Tensor:
    """``q . k`` of queries ``start:stop`` and keys ``:width``, ``[B, H_kv, group,
    stop - start, width]``: fp32 out of fp16/bf16 on CUDA (its matmul writes the fp32
    accumulator, not a rounded copy); in q's dtype elsewhere (the CPU has no such
    matmul, and a float32 copy of q and k is what this pass avoids)."""
    b, hkv, group, _, d = grouped.shape
    rows = grouped[:, :, :, start:stop].reshape(b * hkv, -1, d)  # one slab of q
    wide = {"out_dtype": torch.float32} if grouped.is_cuda and \
        grouped.dtype in (torch.float16, torch.bfloat16) else {}
    logits = torch.bmm(rows, keys[:, :width].transpose(1, 2), **wide)
    return logits.view(b, hkv, group, stop - start, width)


def record_max_logits(attention, q: torch.Tensor, k: torch.Tensor, *, causal: bool = True,
                      scale: float | None = None, mask: torch.Tensor | None = None) -> None:
    """Called by an attention module's forward: folds this forward's per-head max logits
    into the step's running max (no autograd graph; ``max_logits``'s arguments). A no-op
    unless tracked, for a forward without grad (an evaluation; reentrant checkpointing's
    first pass, whose recompute records the same values) and for non-reentrant
    checkpointing's recompute (its forward recorded them already)."""
    if not _records(attention):
        return
    with torch.no_grad():
        now = max_logits(q.detach(), k.detach(), causal=causal, scale=scale, mask=mask)
    _fold(attention, now, k.shape[1])


def _records(attention) -> bool:
    return is_tracking(attention) and torch.is_grad_enabled() and not _recomputing()


def _fold(attention, now: torch.Tensor, kv_heads: int) -> None:
    running = getattr(attention, _MAX_ATTR)
    setattr(attention, _MAX_ATTR, now if running is None else torch.maximum(running, now))
    attention._dmuon_kv_heads = kv_heads


def _recomputing() -> bool:
    """Whether this forward is non-reentrant checkpointing's recompute: the saved-tensor
    hooks on top are those torch.utils.checkpoint pushes for it (matched by their code,
    not by name). Should torch change them, this answers False and the recompute
    records the same maxima again: slower, never wrong."""
    from torch.utils.checkpoint import _recomputation_hook

    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    code = getattr(hooks[1], "__code__", None) if hooks else None
    return code is not None and code in _recomputation_hook.__init__.__code__.co_consts


_FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _use_flex(device_type: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``attention`` runs as one flex_attention kernel that also returns the max
    scores: on CUDA only (torch 2.13's flex_attention refuses max scores and a backward
    on the CPU), in the dtypes its Triton kernel takes (not float64), head_dim a power
    of two from 16 to 256 (what its kernel tiles without padding)."""
    return (device_type == "cuda" and dtype in _FLEX_DTYPES and 16 <= head_dim <= 256
            and head_dim & (head_dim - 1) == 0)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # uncompiled, flex_attention runs an unfused reference that materialises the scores
    return torch.compile(flex_attention, dynamic=False)


def _causal(b, h, q_index, kv_index):
    return q_index >= kv_index


@functools.lru_cache(maxsize=8)  # a job's few sequence lengths: built once, not per layer
def _causal_block_mask(t: int, s: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    with torch.no_grad():
        return create_block_mask(_causal, None, None, t, s, device=device)


def _flex_attention(q, k, v, causal: bool, scale: float | None):
    """(output ``[B, H_q, T, D]``, per-query-head max logit ``[H_q]``, float32) from one
    flex_attention kernel: its max scores are the row maxima of ``q . k * scale`` over
    the attended keys, reduced here over batch and queries."""
    from torch.nn.attention.flex_attention import AuxRequest

    block_mask = _causal_block_mask(q.shape[2], k.shape[2], q.device) if causal else None
    out, aux = _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale,
                                enable_gqa=q.shape[1] != k.shape[1],
                                return_aux=AuxRequest(max_scores=True))
    return out, aux.max_scores.detach().amax(dim=(0, 2))


def attention(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """``softmax(q . k * scale) v`` (SDPA's ``is_causal``, GQA by broadcasting the key
    heads: q ``[B, H_q, T, D]``, k and v ``[B, H_kv, S, D]``) with the max logits recorded
    as ``record_max_logits`` records them. Where QK-clip tracks ``module``, grad is on and
    ``_use_flex`` allows, one flex_attention kernel gives both (a recompute runs it too,
    so it saves what its forward saved, and records nothing); else SDPA after the
    fallback pass (``max_logits``) where it records."""
    if is_tracking(module) and torch.is_grad_enabled() and \
            _use_flex(q.device.type, q.dtype, q.shape[-1]):
        out, now = _flex_attention(q, k, v, causal, scale)
        if not _recomputing():
            _fold(module, now, k.shape[1])
        return out
    record_max_logits(module, q, k, causal=causal, scale=scale)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # SDPA's enable_gqa measured 10-15 % slower in the CPU's fwd + bwd
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def scales(maxima: torch.Tensor, kv_heads: int, tau: float):
    """``(q_scale [H_q], k_scale [H_kv])`` for per-head max logits ``maxima``: each
    head's logits scale by ``min(1, tau / S_h)`` (the GQA rule in the module's doc)."""
    gamma = tau / maxima.clamp(min=tau)
    # a non-finite max (a broken forward) is no measure of the head: left alone
    gamma = torch.where(maxima.isfinite(), gamma, 1.0).reshape(kv_heads, -1)
    group = gamma.amin(dim=1, keepdim=True)
    return (gamma / group.sqrt()).reshape(-1), group.sqrt().reshape(-1)


def _scale_heads(master: torch.Tensor, head_scale: torch.Tensor) -> None:
    """Scales the rows of each head (``rows / heads`` rows apiece) in place."""
    heads = head_scale.numel()
    master.view(heads, -1, master.shape[-1]).mul_(
        head_scale.to(master.dtype)[:, None, None])


def _projection(module, name: str, path: str) -> torch.Tensor:
    """``module``'s weight at ``path``; refused where TP splits it on columns (its heads'
    logits would be partial sums on each TP rank)."""
    weight = module.get_parameter(path)
    if any(getattr(p, "dim", 0) == 1 for p in getattr(weight, "placements", ())):
        raise ValueError(f"dmuon.Muon(qk_clip=...): '{name}.{path}' is split on its "
                         "columns (rowwise TP); QK-clip needs whole heads per TP rank "
                         "(colwise q/k)")
    return weight


def _check_tau(tau) -> float:
    if tau is True:
        return TAU
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or \
            not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"dmuon.Muon: qk_clip must be tau > 0, the largest max logit "
                         f"allowed (True: the Kimi K2 report's {TAU}), got {tau!r}")
    return float(tau)


class QKClip:
    """``dmuon.Muon(qk_clip=tau)``'s part: the model's attention modules (every rank
    finds the same ones, in the same order), one MAX all-reduce per data-parallel group
    and step for all of their heads, and the owned q/k rows scaled."""

    def __init__(self, model, tau, masters: dict[int, torch.Tensor]):
        """``masters``: ``id(module param)`` -> this rank's master, for the owned ones."""
        self.tau = _check_tau(tau)
        self.attention = []  # (name, module, q master or None, k master or None)
        for name, module in model.named_modules():
            paths = getattr(module, WEIGHTS_ATTR, None)
            if paths is None:
                continue
            q, k = (_projection(module, name, path) for path in paths)
            self.attention.append((name, module, masters.get(id(q)), masters.get(id(k))))
            setattr(module, _MAX_ATTR, None)
        if not self.attention:
            raise ValueError("dmuon.Muon(qk_clip=...): no module of the model names its "
                             f"q/k projections in `{WEIGHTS_ATTR}` (see dmuon.qk_clip)")
        self.max_logit, self.clipped_heads = None, 0

    def discard(self) -> None:
        """``zero_grad``: the forwards of the dropped gradients no longer count."""
        for _, module, _, _ in self.attention:
            setattr(module, _MAX_ATTR, None)

    def _step_maxima(self) -> list[torch.Tensor]:
        maxima = []
        for name, module, _, _ in self.attention:
            running = getattr(module, _MAX_ATTR)
            if running is None:
                raise RuntimeError(f"dmuon.Muon(qk_clip=...): attention module '{name}' "
                                   "recorded no max logits this step; its forward must "
                                   "call dmuon.qk_clip.record_max_logits")
            maxima.append(running)
            setattr(module, _MAX_ATTR, None)
        return maxima

    def clip(self, groups, ledger, skip: bool, tp_group=None) -> None:
        """After the update, before the post-step broadcast: every rank calls it (a
        skipped step, agreed on every rank, clips nothing and sends nothing).
        ``groups``: the data-parallel ``(group, dim)`` the maxima are reduced over."""
        self.max_logit, self.clipped_heads = None, 0
        if skip:
            self.discard()
            return
        maxima = self._step_maxima()
        flat = torch.cat(maxima)
        for group, dim in groups:
            comm.wait(comm.all_reduce_max(flat, group, ledger, dim, "step"))
        self._record(flat, tp_group, ledger)
        parts = flat.split([m.numel() for m in maxima])
        over = torch.stack([(part > self.tau).any() for part in parts]).tolist()  # 1 sync
        for (_, module, q, k), part, clipped in zip(self.attention, parts, over):
            if not clipped or (q is None and k is None):
                continue
            kv_heads = module._dmuon_kv_heads
            q_scale, k_scale = scales(part, kv_heads, self.tau)
            if q is not None:
                _scale_heads(q, q_scale)
            if k is not None:
                _scale_heads(k, k_scale)

    def _record(self, flat: torch.Tensor, tp_group, ledger) -> None:
        """The step's largest max logit and heads clipped, the TP peers' heads counted
        too (two one-value all-reduces over TP), so every rank records the same."""
        top = flat.max().reshape(1)
        count = (flat > self.tau).sum().reshape(1).to(flat.dtype)
        if tp_group is not None:
            comm.wait(comm.all_reduce_max(top, tp_group, ledger, "tp", "step"))
            comm.wait(comm.all_reduce_sum(count, tp_group, ledger, "tp", "step"))
        top_value, count_value = torch.cat([top, count]).tolist()  # one host sync
        self.max_logit, self.clipped_heads = top_value, int(count_value)


def for_optimizer(state, tau, member_of: dict) -> QKClip | None:
    """``dmuon.Muon(qk_clip=tau)``'s QK-clip over the dedicated model's attention modules
    (``state``: its ``DedicatedModel``; ``member_of``: id(master) -> its partition
    member), or None when tau is None or False."""
    if tau is None or tau is False:
        return None
    model = state.model()
    if model is None:
        raise ValueError("dmuon.Muon(qk_clip=...) needs the dedicated model")
    masters = {id(member_of[id(t)].param): t for t in state.owned_params.values()}
    return QKClip(model, tau, masters)
