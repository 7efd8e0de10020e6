"""The reference implementation's Muon-only clipping: ``clip_grad_norm_(optimizer,
max_norm, strategy=...)`` clips the gradients Muon steps (this rank's owned matrices,
after their reduces have landed) by a registered strategy, and returns
``MuonGradClipStats``. Without ``strategy``, ``dmuon.clip_grad_norm_`` keeps its own
meaning: the global norm of every gradient (``dmuon/grads.py``).

A strategy is ``fn(grads, max_norm, *, norm_type, all_reduce) -> MuonGradClipStats``:
``grads`` the live gradient tensors (scale them in place), ``all_reduce(t, op)`` sums
(or maxes) a tensor over the model's whole layout on DMuon's own groups. The built-in
``"global_norm"`` is ``dmuon.clip_buckets``' formula over one bucket of them all.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from . import comm
from .clip_buckets import GradClipBucket, bucket_stats

_STRATEGIES: dict = {}


@dataclasses.dataclass
class MuonGradClipStats:
    """What a Muon clip did: ``total_norm`` before clipping, ``clip_coef``, ``clipped``,
    ``found_inf`` (0-dim tensors), ``max_norm`` (None: stats only), the strategy's name
    and how many gradients it saw on this rank."""

    total_norm: torch.Tensor
    clip_coef: torch.Tensor
    clipped: torch.Tensor
    found_inf: torch.Tensor
    max_norm: float | None
    strategy: str
    num_grads: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def register_muon_grad_clip_strategy(name: str, strategy) -> None:
    """Make ``strategy`` (see the module docstring) available as
    ``clip_grad_norm_(..., strategy=name)``. The built-in ``"global_norm"`` stays."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty string, got {name!r}")
    if name == "global_norm":
        raise ValueError("'global_norm' is the built-in strategy; register another name")
    if not callable(strategy):
        raise TypeError(f"strategy {name!r} must be callable, got {type(strategy).__name__}")
    _STRATEGIES[name] = strategy


def global_norm(grads, max_norm, *, norm_type: float, all_reduce) -> MuonGradClipStats:
    bucket = GradClipBucket("muon", grads, norm_type=norm_type)
    acc = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    power = torch.zeros((), dtype=acc, device=_device_of(grads))
    for g in grads:
        power = torch.maximum(power, g.abs().max().to(acc)) if math.isinf(norm_type) \
            else power + g.to(acc).abs().pow(norm_type).sum()
    power = all_reduce(power, dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    s = bucket_stats(bucket, power, max_norm)
    for g in grads:
        g.mul_(s.clip_coef.to(g.dtype))
    return MuonGradClipStats(s.total_norm, s.clip_coef, s.clipped, s.found_inf, max_norm,
                             "global_norm", len(grads))


def _device_of(grads):
    return grads[0].device if grads else torch.device("cpu")


def _layout_all_reduce(state):
    """``all_reduce(t, op)`` over every rank of the layout: the shard group, then the
    replicate group, then the TP group of dedicated TP shards (DMuon's own groups)."""
    ctx = state.ctx
    tp = next((m.tp.group for b in state.boundaries for m in b.members if m.tp is not None),
              None)

    def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        t = t.to(ctx.device)
        reduce = comm.all_reduce_max if op == dist.ReduceOp.MAX else comm.all_reduce_sum
        for group, dim in ((ctx.reduce_group, "shard"), (ctx.replicate_group, "replicate"),
                           (tp, "tp")):
            if group is not None:
                comm.wait(reduce(t, group, ctx.ledger, dim, "step"))
        return t
    return all_reduce


@torch.no_grad()
def clip_muon_grads(state, max_norm, *, norm_type: float, error_if_nonfinite: bool,
                    strategy) -> MuonGradClipStats:
    """The Muon gradients of ``state``'s model (route ``muon``, this rank's owned ones)
    clipped by ``strategy`` (a registered name or a callable)."""
    fn = global_norm if strategy == "global_norm" else _STRATEGIES.get(strategy, strategy)
    if not callable(fn):
        raise ValueError(f"clip_grad_norm_: strategy={strategy!r} is not registered; there "
                         f"are {['global_norm', *_STRATEGIES]}")
    state.finish_gradient_sync()
    grads = [b.masters[m.fqn].grad for b in state.boundaries for m in b.owned
             if state.plan.params[m.fqn].route == "muon"
             and b.masters[m.fqn].grad is not None]
    stats = fn(grads, max_norm, norm_type=float(norm_type),
               all_reduce=_layout_all_reduce(state))
    if error_if_nonfinite and bool(stats.found_inf):
        raise RuntimeError(f"clip_grad_norm_: the Muon gradient norm is {stats.total_norm}")
    return stats
