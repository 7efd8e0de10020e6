"""What every rank must decide alike at the step, in one small all-reduce.

Whether any rank produced a gradient for a unit travels in one small all-reduce per
step: a matrix no rank touched keeps ``grad = None`` and the optimizer skips it, as
FSDP2 and ``torch.optim`` do for their own params.

The same all-reduce carries one flag per rank, set when a gradient this rank reduced
was not finite (its NaN or inf would reach every owner), and one for FSDP2's reduced
shards: every rank learns the same set of ranks, so every rank skips the same steps.
The flags are summed over every group the step's collectives use, TP included: TP peers
hold different shards of a matrix (one may see a NaN or a gradient the other does not),
and a peer that skipped while the other all-reduced its Gram would hang NCCL.
"""

from __future__ import annotations

import torch

from . import comm
from .nonfinite import is_nonfinite


class StepAgreement:
    """Per unit: a gradient somewhere; per rank: a non-finite local gradient; last: a
    non-finite FSDP2 shard. Summed over every rank of the layout at the step."""

    def __init__(self, ctx, num_units: int):
        self.ctx, self.num_units = ctx, num_units
        self.rank = ctx.replicate_rank * ctx.shard_size + ctx.shard_rank
        world = ctx.shard_size * ctx.replicate_size
        self.presence = torch.zeros(num_units + world + 1, dtype=torch.float32,
                                    device=ctx.device)
        self.nonfinite: list | None = None  # this step's flagged ranks, once known
        self._groups = self._work = self._present = None

    # -- during backward -------------------------------------------------------------
    def note_gradient(self, unit_index: int) -> None:
        self.presence[unit_index] = 1.0

    def check_reduced(self, flat: torch.Tensor) -> None:
        """Flag this rank when a gradient it is about to reduce is not finite."""
        self.presence[self.num_units + self.rank] += is_nonfinite(flat).float()

    # -- at the step -----------------------------------------------------------------
    @property
    def issued(self) -> bool:
        return self._groups is not None

    def issue(self, fsdp2_nonfinite: torch.Tensor | None) -> None:
        """Start the sum over the first group (on groups no reduce is queued on, so it
        does not wait for them)."""
        if fsdp2_nonfinite is not None:
            self.presence[-1] += fsdp2_nonfinite
        self._groups = self.agreement_groups()
        group, dim = self._groups[0]
        self._work = comm.all_reduce_sum(self.presence, group, self.ctx.ledger, dim, "step")

    def data_parallel_groups(self) -> list[tuple]:
        """``(group, dim)``: shard, then replicate where it has peers; reductions over
        them, one after the other, reach every data-parallel rank."""
        ctx = self.ctx
        groups = [(ctx.shard_group, "shard")]
        if ctx.replicate_size > 1:
            groups.append((ctx.presence_group, "replicate"))
        return groups

    def agreement_groups(self) -> list[tuple]:
        """The data-parallel groups and TP where it has peers: every rank of the layout."""
        tp = self.ctx.tp_group
        return self.data_parallel_groups() + ([(tp, "tp")] if tp is not None else [])

    def any_rank(self, flag: torch.Tensor) -> bool:
        """Whether ``flag`` (one float, nonzero: set) is set on any rank of the layout;
        every rank calls it."""
        total = flag.reshape(1).float()
        for group, dim in self.agreement_groups():
            comm.wait(comm.all_reduce_sum(total, group, self.ctx.ledger, dim, "step"))
        return bool(total.item())

    def present(self) -> list:
        """Which units got a gradient on any rank this step (waited for once); sets
        ``nonfinite`` to the flagged ranks (or ["fsdp2"])."""
        if self._present is None:
            comm.wait(self._work)
            for group, dim in self._groups[1:]:
                comm.wait(comm.all_reduce_sum(self.presence, group, self.ctx.ledger, dim,
                                              "step"))
            self._present = self.presence.tolist()
            flags = self._present[self.num_units:]
            world = len(flags) - 1
            self.nonfinite = [r for r in range(world) if flags[r]] or \
                (["fsdp2"] if flags[-1] else [])
        return self._present

    def add_nonfinite(self, names: list) -> None:
        """Ranks outside this layout whose gradients were not finite (a pipeline's other
        stages): this step is skipped here too."""
        self.nonfinite = (self.nonfinite or []) + list(names)

    def close(self, touched: bool) -> None:
        """The step is over; ``touched``: some gradient was noted since the last close."""
        if touched:
            self.presence.zero_()
        self._groups = self._work = self._present = None
