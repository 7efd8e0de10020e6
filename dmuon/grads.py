"""Gradient accumulation without communication, and clipping across owned and FSDP2
gradients."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from . import comm
from .model_state import get_state, is_dedicated
from .muon_clip import clip_muon_grads


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Accumulate gradients locally; the first backward after the context reduces the
    accumulated sum (DMuon's reduce and FSDP2's reduce-scatter alike). Without it,
    repeated backward passes accumulate too, each one reducing its own gradient."""
    state = get_state(model)
    fsdp_modules = [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]
    state.set_gradient_sync(False)
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        state.set_gradient_sync(True)
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)


def _model_of(model_or_optimizer) -> nn.Module:
    if isinstance(model_or_optimizer, nn.Module):
        return model_or_optimizer
    state = getattr(model_or_optimizer, "_state", None)
    model = state.model() if state is not None else None
    if model is None:
        raise TypeError("clip_grad_norm_ takes a dedicated model or its dmuon.Muon optimizer, "
                        f"got {type(model_or_optimizer).__name__}")
    return model


def _tp_sharded(g) -> bool:
    """Whether an FSDP2 gradient is also split by tensor parallelism (its ``tp`` dim)."""
    names = getattr(getattr(g, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tp" in names and g.placements[names.index("tp")].is_shard()


def _tp_group(state):
    """The TP group of the model's dedicated shards and its size (None, 1 without TP)."""
    tp = next((m.tp for b in state.boundaries for m in b.members if m.tp is not None), None)
    return (tp.group, tp.size) if tp is not None else (None, 1)


def _squares(state, model, acc, T: int) -> torch.Tensor:
    """Summed squares of [owned, FSDP2] gradients. Under tensor parallelism a part of a
    matrix split over the TP group counts in full (the TP sum adds the other parts),
    a tensor that the group's T ranks all hold counts 1/T on each."""
    sq = torch.zeros(2, dtype=acc, device=state.ctx.device)
    for b in state.boundaries:
        for m in b.owned:
            g = b.masters[m.fqn].grad
            if g is not None:
                sq[0] += g.to(acc).pow(2).sum() / (1 if m.tp is not None else T)
    for p in model.parameters():
        if not is_dedicated(p) and p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            sq[1] += local.to(acc).pow(2).sum() / (1 if _tp_sharded(p.grad) else T)
    return sq


def _gradients(state, model) -> list[torch.Tensor]:
    owned = [p.grad for p in state.owned_params.values() if p.grad is not None]
    sharded = [p.grad for p in model.parameters() if not is_dedicated(p) and p.grad is not None]
    return owned + [g.to_local() if hasattr(g, "to_local") else g for g in sharded]


def squared_norm(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The squared global 2-norm of a dedicated model's gradients, summed over its layout
    (collective), and this rank's gradients it counts. Owned gradients live on one
    data-parallel coordinate; FSDP2 gradients are sharded on the shard dim and replicated
    on the replicate dim, so their squares are divided by R before the sum over all R x N
    coordinates; under tensor parallelism TP shards are summed over the TP group and what
    its T ranks all hold counts once. A pipeline sums it over its stages."""
    state = get_state(model)
    state.finish_gradient_sync()
    grads, ctx = _gradients(state, model), state.ctx
    # squares summed in at least fp32 (bf16 gradients under mixed precision)
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    tp_group, T = _tp_group(state)
    sq = _squares(state, model, acc, T)
    comm.wait(comm.all_reduce_sum(sq, ctx.reduce_group, ctx.ledger, "shard", "step"))
    if ctx.replicate_size > 1:
        comm.wait(comm.all_reduce_sum(sq, ctx.replicate_group, ctx.ledger, "replicate", "step"))
    if tp_group is not None:
        comm.wait(comm.all_reduce_sum(sq, tp_group, ctx.ledger, "tp", "step"))
    return sq[0] + sq[1] / ctx.replicate_size, grads


def clip_to(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float,
            error_if_nonfinite: bool, eps: float) -> None:
    """Scale ``grads`` so that a global norm of ``total`` becomes at most ``max_norm``."""
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(f"clip_grad_norm_: the total gradient norm is {total.item()}")
    coef = float(max_norm) / (total.item() + eps)
    if coef < 1 and math.isfinite(coef):
        for g in grads:
            g.mul_(coef)


def check_norm_type(norm_type: float) -> None:
    if norm_type != 2.0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type} is not supported; the "
                         "global 2-norm is (norm_type=2.0)")


@torch.no_grad()
def clip_grad_norm_(model_or_optimizer, max_norm: float, *, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, eps: float = 1e-6, foreach=None,
                    strategy=None):
    """Clip the global 2-norm of every gradient of a dedicated model (owned and FSDP2
    alike; pass the model or its ``dmuon.Muon``); returns the norm before clipping.
    With ``strategy`` (``"global_norm"`` or a registered one): the reference's
    Muon-only clip (``dmuon.muon_clip``), returning ``MuonGradClipStats``; ``foreach``
    is accepted for its signature and changes nothing. Collective; what the norm counts:
    ``squared_norm``. Under pipeline parallelism ``PipelineMuon.clip_grad_norm_`` sums it
    over the stages.
    """
    if strategy is not None:
        return clip_muon_grads(get_state(_model_of(model_or_optimizer)), max_norm,
                               norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                               strategy=strategy)
    check_norm_type(norm_type)
    sq, grads = squared_norm(_model_of(model_or_optimizer))
    total = sq.sqrt()
    clip_to(grads, total, max_norm, error_if_nonfinite, eps)
    return total
