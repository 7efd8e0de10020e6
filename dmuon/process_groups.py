"""DMuon's own process groups: made in one order on every rank, warmed at set-up.

``new_group`` is collective over the world, so every rank makes every group, in one
order. NCCL builds a communicator lazily, at its first collective; a group first used
deep inside a step (the EP all-to-all, the replicate stage) then initialises there, on
some ranks and not yet on others, and a 2-node CP 4 x EP 8 Muon run deadlocked that way
until every communicator was warmed at optimizer construction (prime-rl issue 3490).
So each rank runs one tiny all-reduce on each of its groups at set-up, in creation
order: the first group any rank waits on has every member already past its earlier
groups, so the warm-up cannot deadlock.

A communicator also holds device memory that no tensor shows: 544 MiB for a 2-GPU
group and 688 MiB beyond on A100 with NVLink (NVIDIA/nccl issue 964), about 1.6 GB with
NVLS on H100 (issue 864). ``COMMUNICATOR_BYTES`` is the first figure, a stated estimate:
NCCL_BUFFSIZE, the channel count and NVLS move it either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

COMMUNICATOR_BYTES = 544 * 2**20


@dataclass
class Communicators:
    """The groups DMuon made that this rank belongs to: (name, ranks, group), in
    creation order (the same relative order on every rank)."""

    mine: list = field(default_factory=list)

    def new_group(self, ranks, name: str):
        ranks = tuple(int(r) for r in ranks)
        group = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            self.mine.append((name, ranks, group))
        return group

    def warm(self, device: torch.device) -> None:
        """One 4-byte all-reduce on each of this rank's groups, in creation order."""
        for _, _, group in self.mine:
            dist.all_reduce(torch.zeros(1, device=device), group=group)

    def report(self) -> dict:
        """Names and members of this rank's DMuon groups, and their estimated bytes."""
        return {"count": len(self.mine),
                "groups": [(name, list(ranks)) for name, ranks, _ in self.mine],
                "estimated_bytes": len(self.mine) * COMMUNICATOR_BYTES}


def mesh_device(mesh) -> torch.device:
    """The device a mesh's collectives run on (this rank's current CUDA device)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def communicators_per_rank(replicate: int, ep: int) -> int:
    """How many groups DMuon makes that one rank belongs to: the shard group twice
    (gathers and reduces on separate communicators), the replicate group twice (its
    post-step broadcast and the step's agreement) where R > 1, and under EP the expert
    shard group twice and the EP group."""
    return 2 + (2 if replicate > 1 else 0) + (3 if ep > 1 else 0)
