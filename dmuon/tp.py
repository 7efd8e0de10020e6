"""Newton-Schulz on a matrix sharded by tensor parallelism (TP first, then DMuon).

Each owner holds its TP shard; the owners of one matrix are the TP peers at the same DP
slot, and they orthogonalise it together:

- shard splits the longer (or equal) dimension: orient X wide with the split along its
  columns; X Xᵀ is then the sum of the per-shard Gram matrices, one m x m all-reduce
  per Gram computation (two with a restart), and Q X is local. Square matrices too.
- shard splits the shorter dimension (colwise k/v under grouped-query attention): the
  m x m Gram needs cross-shard blocks, so the shards are all-gathered, each peer runs NS
  on the full matrix and keeps its own slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from . import comm
from .newton_schulz import (
    _gram,
    coefficient_schedule,
    default_ns_dtype,
    gram_matmuls,
    newton_schulz,
    norm_floor,
    ns_flops,
    restart_index,
)

GRAM_ALLREDUCE, GATHER = "gram_allreduce", "gather"


@dataclass(frozen=True)
class TPShard:
    """How a dedicated DTensor param is split on its (1-D) TP mesh."""

    mesh: object
    placements: tuple
    full_shape: tuple[int, int]
    shard_dim: int  # 0: rows (out, colwise), 1: columns (in, rowwise)

    @property
    def group(self):
        return self.mesh.get_group()

    @property
    def size(self) -> int:
        return self.mesh.size()

    def as_dtensor(self, local: torch.Tensor):
        """``local`` (this peer's shard of the matrix) as the DTensor it is a shard of."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=torch.Size(self.full_shape),
                                  stride=(self.full_shape[1], 1))

    def rows_as_dtensor(self, local: torch.Tensor):
        """A per-row state of this peer's shard (``(rows, 1)``) as a DTensor: sharded
        like the rows, or replicated when the split is on the columns."""
        from torch.distributed.tensor import DTensor, Replicate

        rows = self.full_shape[0]
        placements = self.placements if self.shard_dim == 0 else (Replicate(),)
        return DTensor.from_local(local, self.mesh, placements, run_check=False,
                                  shape=torch.Size((rows, 1)), stride=(1, 1))

    @property
    def mode(self) -> str:
        return mode_of(self.full_shape, self.shard_dim)


def tp_shard_of(param) -> TPShard | None:
    """The TP layout of a DTensor param, or None when it is not sharded."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    if param.device_mesh.ndim != 1:
        raise ValueError(
            f"dedicated DTensor params must live on a 1-D TP mesh, got {param.device_mesh}"
        )
    placement = param.placements[0]
    if not isinstance(placement, Shard):
        return None
    if param.ndim != 2 or placement.dim not in (0, 1, -1, -2):
        raise ValueError(f"unsupported TP placement {param.placements} for shape {param.shape}")
    return TPShard(param.device_mesh, tuple(param.placements), tuple(param.shape),
                   placement.dim % 2)


def tp_newton_schulz(local: torch.Tensor, shard: TPShard, *, steps, backend, coefficients, dtype,
                     eps, ledger: comm.Ledger, restart: bool = True,
                     gram_dtype: torch.dtype | None = None) -> torch.Tensor:
    """This peer's shard of NS(full matrix), with the communication the rule needs (none
    on a TP group of one, whose shard is the whole matrix: NS as without TP, bit for
    bit)."""
    if shard.size == 1:
        return newton_schulz(local, steps, backend, coefficients, dtype, eps, restart, gram_dtype)
    dtype = dtype or default_ns_dtype(local.device, backend, local.dtype)
    if shard.mode == GATHER:
        parts = [torch.empty_like(local) for _ in range(shard.size)]
        ledger.record("all_gather", local.numel() * local.element_size() * shard.size,
                      shard.size, "tp", "step")
        dist.all_gather(parts, local.contiguous(), group=shard.group)
        full = torch.cat(parts, dim=shard.shard_dim)
        out = newton_schulz(full, steps, backend, coefficients, dtype, eps, restart, gram_dtype)
        return out.chunk(shard.size, dim=shard.shard_dim)[dist.get_rank(shard.group)]

    def gram_sum(r: torch.Tensor) -> torch.Tensor:
        comm.wait(comm.all_reduce_sum(r, shard.group, ledger, "tp", "step"))
        return r

    X, R = _normalised_shard(local.mT if shard.shard_dim == 0 else local, gram_sum)
    out = _gram(X.to(dtype), coefficient_schedule(coefficients, steps), restart, gram_sum,
                inner=gram_dtype or dtype, first_gram=R)
    return out.mT if shard.shard_dim == 0 else out


def _normalised_shard(X: torch.Tensor, gram_sum):
    """A wide X whose columns are split over the TP peers, over the whole matrix's
    Frobenius norm, and its first Gram X Xᵀ: the Gram is summed over the peers in fp32
    (fp64 for fp64 input), and ‖X‖² is its trace, so no half-precision step ever holds
    an unnormalised value (fp16 gave NaN at element scale 1e-6 when it did)."""
    X = X.to(torch.float64 if X.dtype == torch.float64 else torch.float32)
    R = gram_sum(X @ X.mT)
    norm = R.diagonal(dim1=-2, dim2=-1).sum(-1).sqrt().clamp(min=norm_floor(X.dtype))
    return X / norm, R / (norm * norm)


# -- what NS over TP shards costs, from shapes alone (the planner's) ----------------------
def mode_of(full_shape, split_dim: int) -> str:
    """How a 2-D matrix split on ``split_dim`` is orthogonalised (``TPShard.mode``)."""
    split, other = full_shape[split_dim], full_shape[1 - split_dim]
    return GRAM_ALLREDUCE if split >= other else GATHER


def peer_ns_flops(full_shape, split_dim: int, T: int, steps: int = 5) -> int:
    """One peer's NS FLOPs for its shard: Gram NS on m x n/T (the m x m iteration
    repeated on every peer), or NS of the whole gathered matrix."""
    if mode_of(full_shape, split_dim) == GATHER:
        return ns_flops(full_shape, steps)
    m, n = full_shape[1 - split_dim], full_shape[split_dim] // T
    rect = 2 + (2 if restart_index(steps, True) is not None else 0)
    return rect * 2 * m * m * n + gram_matmuls(steps, True) * 2 * m ** 3


def ns_bytes(mode: str, full_shape, T: int, *, gram_elt: int, master_elt: int,
             steps: int) -> Fraction:
    """The ``tp`` bytes (phase ``step``) each peer sends to orthogonalise one matrix: its
    shards all-gathered, or its Gram matrices all-reduced, the first in fp32 (fp64 for
    fp64 masters, ``_normalised_shard``), the restart's in ``gram_elt``."""
    if mode == GATHER:
        return Fraction(T - 1, T) * math.prod(full_shape) * master_elt
    m = min(full_shape)
    grams = 2 if restart_index(steps, True) is not None else 1
    first_elt = 8 if master_elt == 8 else 4
    return (first_elt + (grams - 1) * gram_elt) * Fraction(2 * (T - 1), T) * m * m
