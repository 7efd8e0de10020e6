"""What moves a hook boundary's values: the all-gather that fills its packed buffer from
the shard columns (forward, backward, recompute), and in HSDP the all-gather that brings
every replica of a column the owners' new values after the step.

Both run under ``Streams.issuing`` (on CUDA a side stream, waited for by its consumer
through the ``Pending``); ``fresh`` says the packed buffer already holds the owners'
current values, so a second gather in the same phase sends nothing.
"""

from __future__ import annotations

import torch

from . import comm


class BoundaryTransfer:
    """The gathers of one boundary (``boundary``: its storage, ``buffers.Boundary``)."""

    def __init__(self, boundary):
        self.boundary = boundary
        self.fresh = False  # the packed buffer holds the owners' current values
        self.gather: comm.Pending | None = None
        self.replicate: comm.Pending | None = None

    # -- parameters in ---------------------------------------------------------------
    def start_gather(self, phase: str) -> None:
        """Issue the all-gather that fills the packed buffer from the shard columns."""
        if self.gather is not None or self.fresh:
            return
        b = self.boundary
        b.alloc()
        ctx = b.ctx
        with ctx.streams.issuing("gather") as issued:
            # HSDP: this reads the column values the async replicate all-gather writes.
            # Waited for here, on CUDA only the gather stream waits: a prefetch issued in
            # boundary k's pre-forward must not hold k's compute until k+1's replicate lands
            self.wait_replicate()
            sent = [b.column_values]
            if b.direct:
                work = self._gather_experts(phase, sent)
            else:
                work = comm.all_gather_v(b.packed, b.column_sizes, b.column_values,
                                         ctx.shard_group, ctx.ledger, "shard", phase)
        self.gather = comm.Pending(work, *b.storages(), *sent, issued=issued)

    def _gather_experts(self, phase: str, sent: list):
        """One all-gather per param, each column's experts straight into their place
        (``sent`` keeps what they read alive until they are waited for)."""
        b = self.boundary
        ctx, works = b.ctx, []
        for p in b.params:
            parts = [m for m in b.members if m.param is p]
            sizes = [sum(m.numel for m in parts if m.owner[1] == c)
                     for c in range(ctx.shard_size)]
            views = [b.column_view(m).reshape(-1) for m in parts if m in b.column]
            mine = views[0] if len(views) == 1 else torch.cat(views) if views else \
                b.column_values[:0]
            sent.append(mine)
            works.append(comm.all_gather_v(b.expert_bases[id(p)].view(-1), sizes, mine,
                                           ctx.shard_group, ctx.ledger, "shard", phase))
        return comm.all_of(works)

    @torch.no_grad()
    def wait_gather(self) -> None:
        if self.gather is None:
            return
        self.gather.wait()
        self.gather = None
        b = self.boundary
        for m in b.members if not b.direct else ():
            if m.experts:
                base = b.expert_bases[id(m.param)]
                base[m.experts[0]:m.experts[1]].copy_(
                    b.packed[m.offset:m.offset + m.numel].view(m.shape))
        self.fresh = True

    def settle(self) -> None:
        """Wait for a gather in flight (a prefetch that did not run), so that nothing
        on a side stream still writes the storage about to be released."""
        if self.gather is not None:
            self.gather.wait()
            self.gather = None

    # -- owner's values out ----------------------------------------------------------
    def start_replicate(self) -> None:
        """HSDP: every replica of the column gets the owners' new values."""
        b = self.boundary
        ctx = b.ctx
        self.wait_replicate()
        self.fresh = False
        if ctx.replicate_size == 1 or not b.column:
            return
        mine = b.column_values[b.owned_offset:
                               b.owned_offset + b.replica_sizes[ctx.replicate_rank]]
        with ctx.streams.issuing("gather") as issued:
            work = comm.all_gather_v(b.column_values, b.replica_sizes, mine,
                                     ctx.replicate_group, ctx.ledger, "replicate", "replicate")
        self.replicate = comm.Pending(work, b.column_values, issued=issued)

    def wait_replicate(self) -> None:
        if self.replicate is not None:
            self.replicate.wait()
            self.replicate = None
