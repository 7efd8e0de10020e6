"""Whether a tensor holds a NaN or an inf, without a host sync: every finiteness flag of
the core comes from here.

The sum of a tensor is finite exactly when its elements are, unless the sum itself
overflows. In fp16 (largest finite 65,504) that happens to an all-finite gradient of any
real size, and the step was skipped on every rank for a gradient that was fine. So the
sum is taken with an fp32 accumulator (fp64 for fp64): one read of the tensor, no
full-size temporary (``isfinite().all()`` writes a bool per element), and no overflow
short of 1e38, far beyond gradient, update or parameter scale.
"""

from __future__ import annotations

import torch


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def is_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on ``t``'s device: ``t`` has a NaN or an inf."""
    return ~t.sum(dtype=_accumulator(t.dtype)).isfinite()


def count_nonfinite(tensors) -> torch.Tensor | None:
    """How many of ``tensors`` hold a NaN or an inf, as a 0-dim fp32 on their device
    (None for none)."""
    flags = [is_nonfinite(t) for t in tensors]
    return torch.stack(flags).sum(dtype=torch.float32) if flags else None
