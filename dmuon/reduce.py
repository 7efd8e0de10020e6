"""Gradient reduce: every rank issues the same collectives, in one order, whatever
gradients it produced.

A boundary's reduce-scatter goes out once its backward is done on this rank, but only in
a fixed order (the reverse of the forward order, the same on every rank): a boundary
finished early waits for those before it. A boundary whose params got no gradient here
(a skipped branch, an expert without tokens) still reduces, with zeros, at the latest
when the backward is over, so the sequence of collectives never depends on the data.
Under NCCL a rank-local decision to skip one would hang the job.

Each backward's reduced gradient is added into the owner's master ``.grad``, so
repeated backward passes accumulate as with FSDP2; ``no_sync`` instead keeps summing
locally and reduces once. What every rank must agree on at the step (which units got a
gradient anywhere, which ranks saw a non-finite one) is ``step_agreement``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm
from .buffers import Boundary
from .step_agreement import StepAgreement


def divide_factors(world: int, dtype: torch.dtype) -> tuple[int, int]:
    """(before, after): the gradient sum over ``world`` ranks is divided by ``before``
    on each rank before the reduce and by ``after`` once it lands. fp16 (5 exponent bits)
    can overflow in a large group's sum, so it is divided by about sqrt(world) before
    and the rest after, as FSDP2 does (``_get_gradient_divide_factors``; the same powers
    of two); wider formats sum first and divide once."""
    if dtype in (torch.float32, torch.float64, torch.bfloat16):
        return 1, world
    before = 1
    while world % before == 0 and world / before > before:
        before *= 2
    return before, world // before


@dataclass
class InFlight:
    boundary: Boundary
    column: comm.Pending  # shard stage: this rank's column segment of the sum
    column_out: torch.Tensor
    owned: comm.Pending | None = None  # HSDP replicate stage: the owner's part
    owned_out: torch.Tensor | None = None


class GradientReduce:
    def __init__(self, boundaries: list[Boundary], ctx, num_units: int):
        self.ctx = ctx
        self.order = list(reversed(boundaries))  # backward order, identical on every rank
        self.sync = True
        self.agreement = StepAgreement(ctx, num_units)
        self._ready: set[int] = set()
        self._next = 0
        self._in_flight: list[InFlight] = []
        self.backward_open = False  # a backward ran since the last flush
        self._backward_syncs = True  # `sync` as it was when that backward began
        self._finished = True  # no gradient arrived since the last step closed
        self.step_divisor = 1  # a pipeline's micro-batch count (divide_at_landing)

    def begin_backward(self) -> None:
        if self._finished:  # the first backward since the last step: a new step's flags
            self.agreement.nonfinite = None
        self.backward_open = True
        self._backward_syncs = self.sync

    # -- during backward -------------------------------------------------------------
    def note_gradient(self, boundary: Boundary, param) -> None:
        self._finished = False
        for m in boundary.members:
            if m.param is param:
                self.agreement.note_gradient(m.index)

    def boundary_done(self, boundary: Boundary) -> None:
        """``boundary``'s backward is over on this rank. Its reduce goes out when the
        next boundary's backward begins (``flush``): by then FSDP2 has sent its own
        reduce-scatter for the same block, which the CPU waits for and which would
        otherwise queue behind this bulk transfer. The last boundary goes at once."""
        if not (self._backward_syncs if self.backward_open else self.sync):
            return
        self._ready.add(id(boundary))
        if boundary is self.order[-1]:
            self.flush()

    def flush(self) -> None:
        """Issue the ready reduces the fixed order allows."""
        while self._next < len(self.order) and id(self.order[self._next]) in self._ready:
            self._issue(self.order[self._next])
            self._next += 1
        self._advance(block=False)

    def end_backward(self) -> None:
        """The backward is over: reduce every boundary not reduced yet, in order."""
        if not self.backward_open:
            return
        self.backward_open = False
        if self._backward_syncs:  # a no_sync backward flushed after the context: no reduce
            for boundary in self.order[self._next:]:
                self._issue(boundary)
        self._ready.clear()
        self._next = 0
        self._advance(block=False)

    # -- the collectives -------------------------------------------------------------
    def _issue(self, b: Boundary) -> None:
        # the boundary's groups (an expert-parallel one's: the expert shard group), the
        # divisor the whole data-parallel world's: every rank's tokens reached its experts
        ctx, flat = b.ctx, b.grads.take()
        self._finished = False
        before, _ = divide_factors(self.ctx.shard_size * self.ctx.replicate_size, flat.dtype)
        if before > 1:
            flat.div_(before)
        self.agreement.check_reduced(flat)
        out = torch.empty(b.column_sizes[ctx.shard_rank], dtype=flat.dtype, device=flat.device)
        with ctx.streams.issuing("reduce") as issued:
            work = comm.reduce_scatter_v(out, flat, b.column_sizes, ctx.reduce_group,
                                         ctx.ledger, "shard", "reduce")
        self._in_flight.append(InFlight(b, comm.Pending(work, flat, out, issued=issued), out))

    def _advance(self, block: bool) -> None:
        """HSDP: each column's replicate-stage reduce-scatter goes out once its shard
        stage is done, in issue order (so in the same order on every rank). Called as
        each boundary finishes its backward: every shard stage but the newest was issued
        a whole boundary's backward earlier, so waiting for it costs nothing in the common
        case (on CUDA the wait only orders streams), and the replicate stage overlaps
        the rest of the backward."""
        ctx = self.ctx
        if ctx.replicate_size == 1:
            return
        waiting = [i for i in self._in_flight if i.owned is None and i.boundary.column]
        for n, item in enumerate(waiting):
            if not (block or n < len(waiting) - 1 or item.column.done()):
                return
            _issue_replicate_stage(item, ctx)

    # -- at the step -----------------------------------------------------------------
    def divide_at_landing(self, factor: int) -> None:
        """This step's gradients land divided by ``factor`` too (a pipeline schedule's
        micro-batch count: its loss is each micro-batch's mean)."""
        self.step_divisor = factor

    def prepare_step(self, fsdp2_nonfinite: torch.Tensor | None = None) -> None:
        """The backward is over: every reduce issued, and the step's agreement on its
        way, with whether FSDP2's reduced shards here hold a non-finite value."""
        self.end_backward()
        if not (self._finished or self.agreement.issued):
            self.agreement.issue(fsdp2_nonfinite)

    def land(self, b: Boundary) -> None:
        """Wait for ``b``'s reduces, add its owned part into the masters' ``.grad``; a
        matrix no rank produced a gradient for loses its (zero) gradient."""
        self.prepare_step()
        items = [i for i in self._in_flight if i.boundary is b]
        if not items and self._finished:
            return
        if any(i.owned is None and b.column for i in items):
            self._advance(block=True)
        world = self.ctx.shard_size * self.ctx.replicate_size
        # gradients kept by zero_grad(set_to_none=False): like torch.optim's, they stay
        retained = {m.fqn for m in b.owned if b.masters[m.fqn].grad is not None}
        for item in items:
            _land_item(item, world, self.step_divisor, self.ctx.replicate_size == 1)
            self._in_flight.remove(item)
        present = self.agreement.present()
        for m in b.owned:
            if not present[m.index] and m.fqn not in retained:
                b.masters[m.fqn].grad = None

    def discard(self) -> None:
        """Drop every gradient reduced since the last step (``zero_grad``). Reduces already
        issued are completed, as every rank issued them, and their results thrown away;
        the rest of the backward's reduces go out first, so that every rank issues the
        same collectives whatever it had sent when ``zero_grad`` came."""
        self.end_backward()
        self._advance(block=True)
        for item in self._in_flight:
            item.column.wait()
            if item.owned is not None:
                item.owned.wait()
        self._in_flight.clear()
        if self.agreement.issued:
            self.agreement.present()
        self.close_step()
        self.agreement.nonfinite = None

    def close_step(self) -> None:
        # the flagged ranks outlive the landing: clipping lands the gradients before the
        # step that decides on them; the next step's first backward clears them
        self.agreement.close(touched=not self._finished)
        self._finished, self.step_divisor = True, 1


def _issue_replicate_stage(item: InFlight, ctx) -> None:
    b = item.boundary  # the replicate group is the same for every boundary
    item.owned_out = torch.empty(b.replica_sizes[ctx.replicate_rank],
                                 dtype=item.column_out.dtype, device=ctx.device)
    with ctx.streams.issuing("reduce") as issued:
        item.column.wait()  # on CUDA the reduce stream waits, not the compute stream
        work = comm.reduce_scatter_v(item.owned_out, item.column_out, b.replica_sizes,
                                     ctx.replicate_group, ctx.ledger, "replicate", "reduce")
    item.owned = comm.Pending(work, item.column_out, item.owned_out, issued=issued)


def _land_item(item: InFlight, world: int, step_divisor: int, shard_only: bool) -> None:
    """Wait for ``item``'s reduce and add this rank's part into its boundary's masters:
    the column's under FSDP, the owned part of it under HSDP (a rank that owns none of
    the column lands nothing)."""
    item.column.wait()
    _, after = divide_factors(world, item.column_out.dtype)
    after *= step_divisor
    if shard_only:
        item.boundary.grads.land(item.column_out, after)
    elif item.owned is not None:
        item.owned.wait()
        item.boundary.grads.land(item.owned_out, after)
