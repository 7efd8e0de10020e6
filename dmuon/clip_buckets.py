"""The reference implementation's bucketed gradient clipping: each bucket of gradients
keeps its own norm and clip coefficient (``clip_grad_norm_buckets_``), its Wall-X entry
point (``try_clip_optimizer_grad_norm_buckets_``), and the result types.

The formula of every bucket, with ``p = norm_type`` (2 by default), ``S`` the bucket's
summed ``|g|^p`` over its process group (each tensor's divided by the bucket's
``replicas``, for a tensor every replica holds):

- ``total_norm = S^(1/p)`` (for ``p = inf``, the largest ``|g|`` over the group);
- ``found_inf = not isfinite(total_norm)``;
- ``clip_coef = min(1, max_norm / (total_norm + 1e-6))``, and 1 where ``found_inf`` or
  ``max_norm`` is None (stats only);
- ``clipped = clip_coef < 1``; every gradient of the bucket is multiplied by
  ``clip_coef`` in place (no host sync: the statistics stay 0-dim tensors).

Squares are summed in float64 for float64 gradients, else in float32. Where the
reference has a CUDA fast path this runs torch ops; the statistics and gradients are
the formula's either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


@dataclasses.dataclass
class GradClipBucket:
    """One independently clipped gradient segment: ``grads`` (local tensors), its
    ``name``; ``process_group``: where its squares are summed (default: the call's);
    ``replicas``: how many ranks of that group hold each of its tensors (1: each element
    lives on one rank); ``norm_type``: p."""

    name: str
    grads: Sequence[torch.Tensor]
    process_group: object = None
    replicas: int = 1
    norm_type: float = 2.0


@dataclasses.dataclass
class GradClipBucketStats:
    """One bucket's pre-clip norm, its coefficient and flags (0-dim tensors)."""

    name: str
    total_norm: torch.Tensor
    clip_coef: torch.Tensor
    clipped: torch.Tensor
    found_inf: torch.Tensor
    num_grads: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SegmentedGradClipResult:
    """The result of a multi-bucket clip: each bucket's statistics, in call order."""

    buckets: list[GradClipBucketStats]
    max_norm: float | None

    def stats_by_name(self) -> dict[str, GradClipBucketStats]:
        return {s.name: s for s in self.buckets}


def _acc(grads) -> torch.dtype:
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def _local_power(bucket: GradClipBucket, device) -> torch.Tensor:
    """This rank's summed ``|g|^p`` (or its max for p = inf) of the bucket."""
    acc, p = _acc(bucket.grads), float(bucket.norm_type)
    out = torch.zeros((), dtype=acc, device=device)
    for g in bucket.grads:
        g = g.to_local() if hasattr(g, "to_local") else g
        if g.numel() == 0:
            continue
        if math.isinf(p):
            out = torch.maximum(out, g.detach().abs().max().to(acc))
        else:
            out = out + g.detach().to(acc).abs().pow(p).sum() / bucket.replicas
    return out


def _device(grads, group) -> torch.device:
    """Where a bucket's sum lives: its gradients' device; for an empty bucket, the
    current CUDA device under NCCL, else the CPU."""
    if grads:
        return grads[0].device
    if dist.is_available() and dist.is_initialized() and \
            dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check(bucket: GradClipBucket) -> None:
    p = float(bucket.norm_type)
    if not (p > 0):
        raise ValueError(f"bucket '{bucket.name}': norm_type={p} must be > 0 (or inf)")
    if not (isinstance(bucket.replicas, int) and bucket.replicas >= 1):
        raise ValueError(f"bucket '{bucket.name}': replicas={bucket.replicas} must be an "
                         "int >= 1")


def _reduced(power: torch.Tensor, bucket: GradClipBucket, group) -> torch.Tensor:
    group = bucket.process_group if bucket.process_group is not None else group
    if dist.is_available() and dist.is_initialized():
        op = dist.ReduceOp.MAX if math.isinf(bucket.norm_type) else dist.ReduceOp.SUM
        dist.all_reduce(power, op=op, group=group)
    return power


def bucket_stats(bucket: GradClipBucket, power: torch.Tensor,
                 max_norm: float | None) -> GradClipBucketStats:
    """The formula (module docstring) from the bucket's reduced power sum."""
    p = float(bucket.norm_type)
    total = power if math.isinf(p) else power.pow(1.0 / p)
    found_inf = ~torch.isfinite(total)
    one = torch.ones((), dtype=total.dtype, device=total.device)
    if max_norm is None:
        coef = one
    else:
        coef = torch.clamp(float(max_norm) / (total + EPS), max=1.0)
        coef = torch.where(found_inf, one, coef)
    return GradClipBucketStats(bucket.name, total, coef, coef < 1, found_inf,
                               len(bucket.grads))


@torch.no_grad()
def clip_grad_norm_buckets_(buckets: Sequence[GradClipBucket], max_norm: float | None, *,
                            process_group=None, chunk_size: int | None = None,
                            ) -> SegmentedGradClipResult:
    """Clip each bucket by its own norm (the module docstring's formula); collective over
    each bucket's group, in bucket order, on every rank alike. ``chunk_size`` sizes the
    reference's CUDA kernel launches and changes nothing here (checked, then unused)."""
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int or None")
    if max_norm is not None and not float(max_norm) >= 0:
        raise ValueError(f"max_norm={max_norm} must be >= 0 or None")
    names = [b.name for b in buckets]
    if len(set(names)) != len(names):
        raise ValueError(f"bucket names repeat: {names}")
    out = []
    for bucket in buckets:
        _check(bucket)
        device = _device(bucket.grads, bucket.process_group or process_group)
        power = _reduced(_local_power(bucket, device), bucket, process_group)
        stats = bucket_stats(bucket, power, max_norm)
        for g in bucket.grads:
            g = g.to_local() if hasattr(g, "to_local") else g
            g.mul_(stats.clip_coef.to(g.dtype))
        out.append(stats)
    return SegmentedGradClipResult(out, max_norm)


def try_clip_optimizer_grad_norm_buckets_(optimizer, *, regular_grads: Sequence[torch.Tensor],
                                          adamw_grads: Sequence[torch.Tensor], max_norm: float,
                                          process_group=None) -> SegmentedGradClipResult:
    """The Wall-X pattern: three buckets clipped each by its own norm, ``"regular"``
    (``regular_grads``), ``"muon"`` (this rank's Muon-stepped gradients of ``optimizer``,
    after its reduces have landed) and ``"adamw"`` (``adamw_grads`` and the gradients
    AdamW steps on owners, the ``adamw`` route). Never None here: the reference returns
    None only without its CUDA extension, and this is the torch path."""
    state = getattr(optimizer, "_state", None)
    muon, owner_adamw = [], []
    if state is not None:
        state.finish_gradient_sync()
        owned = {id(t) for t in state.owned_params.values()}
        for group in optimizer.param_groups:
            grads = [p.grad for p in group["params"] if id(p) in owned and p.grad is not None]
            (muon if group["kind"] == "muon" else owner_adamw).extend(grads)
    buckets = [GradClipBucket("regular", list(regular_grads)), GradClipBucket("muon", muon),
               GradClipBucket("adamw", list(adamw_grads) + owner_adamw)]
    return clip_grad_norm_buckets_(buckets, max_norm, process_group=process_group)
