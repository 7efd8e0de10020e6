"""The training recipe: the LR factor at each step, gradient accumulation to the global
batch, and the mixed-precision policy. Pure functions of the spec and the step, so a
resumed run applies exactly what an uninterrupted one does."""

from __future__ import annotations

import math

import torch

from service.job.models.dtypes import DTYPES
from service.job.spec import JobSpec


def lr_factor(spec: JobSpec, step: int) -> float:
    """What multiplies both groups' base LR at ``step`` (0-based): linear warmup from
    1/(warmup+1), then cosine or WSD down to ``min_lr_ratio`` at the last step."""
    s = spec.schedule
    if step < s.warmup_steps:
        return (step + 1) / (s.warmup_steps + 1)
    if s.decay == "constant":
        return 1.0
    span = max(1, spec.steps - 1 - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    if s.decay == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:  # wsd: constant, then linear over the last decay_fraction of the steps
        decay_steps = max(1, round(s.decay_fraction * (spec.steps - s.warmup_steps)))
        start = spec.steps - decay_steps
        shape = 1.0 if step < start else 1 - (step - start + 1) / decay_steps
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * max(0.0, shape)


def mp_policy(spec: JobSpec):
    """FSDP2's MixedPrecisionPolicy (DMuon takes it from ``dmuon.fully_shard``), or None
    when everything runs in the master dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    p = spec.precision
    if not p.mixed:
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[p.compute], reduce_dtype=DTYPES[p.reduce])


def apply_lr(opt: torch.optim.Optimizer, base_lrs: list[float], factor: float) -> dict:
    """Every group's LR set to its base times ``factor``; returns ``{kind: lr}``."""
    out = {}
    for group, base in zip(opt.param_groups, base_lrs):
        group["lr"] = base * factor
        out.setdefault(group.get("kind", "group"), group["lr"])
    return out
