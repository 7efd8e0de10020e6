"""The data-parallel ranks of a (replicate, shard[, tp]) mesh, and the figures taken over
them: which rows a rank reads, the mean of a loss over ranks, the tokens of a step.

The T ranks of a tensor-parallel group read the same rows and hold the same loss (the
head all-gathers the logits to every one of them), so a figure over ranks counts each
data-parallel rank once: R x N of them, never R x N x T. Summing a loss over every rank
and dividing by R x N reported the validation loss T times too large.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .batches import Batches


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among the data-parallel ranks: ``rank`` of ``size`` (R x N),
    shared by the ``tp`` ranks of its tensor-parallel group."""

    rank: int
    size: int
    tp: int

    @classmethod
    def of(cls, mesh: DeviceMesh) -> DataParallel:
        dims = mesh.mesh_dim_names
        named = "replicate" in dims and "shard" in dims  # a pp dim, if any, goes first
        replicate, shard = (mesh["replicate"], mesh["shard"]) if named \
            else (mesh[dims[0]], mesh[dims[1]])
        tp = mesh["tp"].size() if "tp" in dims else 1
        if mesh.size() != dist.get_world_size():  # mean() reduces over the default group
            raise ValueError(f"a {mesh.size()}-rank mesh in a world of "
                             f"{dist.get_world_size()}: the mesh must span every rank")
        return cls(replicate.get_local_rank() * shard.size() + shard.get_local_rank(),
                   replicate.size() * shard.size(), tp)

    def rows(self, batches: Batches, index: int, per_rank: int, micro: int = 0,
             micros: int = 1) -> torch.Tensor:
        """This rank's rows of micro-batch ``micro`` of batch ``index``."""
        return batches.rows(index, per_rank, self.rank, self.size, micro, micros)

    def mean(self, value: torch.Tensor) -> float:
        """The mean over the data-parallel ranks of a per-rank scalar (collective, every
        rank calls it). Summed over every rank on the default group, one all-reduce
        that every rank issues alike, then divided by the world size: each data-parallel
        rank's value comes in once per tensor-parallel peer, which holds the same one."""
        total = value.detach().to(_reduce_device(), torch.float64).reshape(1).clone()
        dist.all_reduce(total)
        return total.item() / (self.size * self.tp)

    def tokens(self, per_rank: int) -> int:
        """A step's tokens over all ranks: each data-parallel rank's once."""
        return per_rank * self.size


def _reduce_device() -> torch.device:
    """Where the default group reduces: the current GPU under NCCL, else the CPU."""
    if "nccl" in dist.get_backend() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
