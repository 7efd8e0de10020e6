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
(after RoPE, ``[batch, heads, tokens, head_dim]``, k before any GQA repeat). The maxima
are rank-local and kept as a running max over the step's micro-batches, so a forward
recomputed under activation checkpointing records nothing new; forwards without grad
(evaluation) are not recorded, and ``zero_grad`` drops the maxima with the gradients.
Under TP each rank records its own (colwise) heads; the maxima are reduced with MAX over
the data-parallel groups only.
"""

from __future__ import annotations

import math

import torch

from . import comm

TAU = 100.0  # Kimi K2 technical report, section 2.1
WEIGHTS_ATTR = "qk_clip_weights"
_MAX_ATTR = "_dmuon_max_logits"  # present (None or the running max) while tracked
_SLAB = 2 ** 26  # logits per slab of query tokens (256 MB in fp32): long sequences fit


def is_tracking(attention) -> bool:
    """Whether ``attention``'s max logits are wanted (a ``dmuon.Muon(qk_clip=...)`` exists)."""
    return hasattr(attention, _MAX_ATTR)


def max_logits(q: torch.Tensor, k: torch.Tensor, *, causal: bool = True,
               scale: float | None = None) -> torch.Tensor:
    """Per query head, the largest of ``q . k * scale`` (default ``1/sqrt(head_dim)``)
    over batch and token pairs; ``causal``: key s after query t masked as SDPA's
    ``is_causal`` does (top-left aligned). Kept in float32 at least."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    work = torch.promote_types(q.dtype, torch.float32)
    scale = d ** -0.5 if scale is None else scale
    grouped = q.to(work).reshape(b, hkv, hq // hkv, t, d)
    k = k.to(work)
    out = torch.full((hkv, hq // hkv), -math.inf, dtype=work, device=q.device)
    per_slab = max(1, _SLAB // (b * hq * s))
    for start in range(0, t, per_slab):
        logits = torch.einsum("bgrtd,bgsd->bgrts", grouped[:, :, :, start:start + per_slab], k)
        if causal:
            rows = torch.arange(start, start + logits.shape[-2], device=q.device)
            later = torch.arange(s, device=q.device)[None, :] > rows[:, None]
            logits = logits.masked_fill(later, -math.inf)
        out = torch.maximum(out, logits.amax(dim=(0, 3, 4)) * scale)
    return out.reshape(hq)


def record_max_logits(attention, q: torch.Tensor, k: torch.Tensor, *, causal: bool = True,
                      scale: float | None = None) -> None:
    """Called by an attention module's forward: folds this forward's per-head max logits
    into the step's running max (no autograd graph). A no-op unless tracked, and for a
    forward without grad (an evaluation; reentrant checkpointing's first pass, whose
    recompute records the same values)."""
    if not (is_tracking(attention) and torch.is_grad_enabled()):
        return
    with torch.no_grad():
        now = max_logits(q.detach(), k.detach(), causal=causal, scale=scale)
    running = getattr(attention, _MAX_ATTR)
    setattr(attention, _MAX_ATTR, now if running is None else torch.maximum(running, now))
    attention._dmuon_kv_heads = k.shape[1]


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
