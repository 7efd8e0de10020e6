"""Gradient accumulation without communication, and clipping across owned and FSDP2
gradients."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from . import comm
from .dedicate import get_state, is_dedicated


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients locally; the first backward after the context reduces the
    accumulated sum (DMuon's reduce and FSDP2's reduce-scatter alike). Without it,
    repeated backward passes accumulate too, each one reducing its own gradient."""
    state = get_state(model)
    fsdp_modules = [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]
    state.reduce.sync = False
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        state.reduce.sync = True
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Clip the global 2-norm of every gradient of a dedicated model; returns the norm.

    Collective. Owned gradients live on exactly one rank; FSDP2 gradients are sharded on
    the shard dim and replicated on the replicate dim, so their squares are divided by R
    before the sum over all R x N ranks.
    """
    state = get_state(model)
    state.finish_gradient_sync()
    owned = [p.grad for p in state.owned_params.values() if p.grad is not None]
    sharded = [p.grad for p in model.parameters() if not is_dedicated(p) and p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in sharded]
    ctx = state.ctx
    # squares summed in at least fp32 (bf16 gradients under mixed precision)
    acc = torch.float64 if any(g.dtype == torch.float64 for g in owned + local) else torch.float32
    sq = torch.zeros(2, dtype=acc, device=ctx.device)
    for i, grads in enumerate((owned, local)):
        for g in grads:
            sq[i] += g.to(acc).pow(2).sum()
    comm.wait(comm.all_reduce_sum(sq, ctx.reduce_group, ctx.ledger, "shard", "step"))
    if ctx.replicate_size > 1:
        comm.wait(comm.all_reduce_sum(sq, ctx.replicate_group, ctx.ledger, "replicate", "step"))
    total = (sq[0] + sq[1] / ctx.replicate_size).sqrt()
    coef = float(max_norm) / (total.item() + eps)
    if coef < 1 and math.isfinite(coef):
        for g in owned + local:
            g.mul_(coef)
    return total
