"""Every collective DMuon issues, the streams it issues them on, and the byte ledger.

Bytes follow the bandwidth-optimal cost model per rank: all-gather, reduce-scatter and
all-to-all move (n-1)/n x S, all-reduce 2(n-1)/n x S, for a payload of S bytes on a group of n
ranks (for the uneven all-gather and reduce-scatter, S is the whole gathered or reduced
tensor; the broadcasts or reduces one is made of on gloo move the same; for the uneven
all-to-all of expert dispatch, S is this rank's input, see ``expert_dispatch``). Counts
are exact (fractions) and kept per mesh dimension (``shard``, ``replicate``, ``tp``,
``ep``, ``pp``: a pipeline's point-to-point sends, their bytes as sent) and
phase (``forward``, ``backward``, ``recompute``, ``reduce``, ``step``, ``replicate``,
``state_dict``, ``checkpoint``).

The collectives are looked up on ``torch.distributed`` at call time, so a test that
patches them sees every call.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from fractions import Fraction

import torch
import torch.distributed as dist

DIMS = ("shard", "replicate", "tp", "ep", "pp")
PHASES = ("forward", "backward", "recompute", "reduce", "step", "replicate", "state_dict",
          "checkpoint")
_FACTOR = {"broadcast": 1, "reduce": 1, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1,
           "all_reduce": 2}


def _key(dim: str, phase: str) -> tuple[str, str]:
    if dim not in DIMS or phase not in PHASES:
        raise ValueError(f"unknown ledger key dim={dim!r} phase={phase!r}")
    return dim, phase


class Ledger:
    """Bytes per (mesh dim, phase) for the step in progress and the last closed step."""

    def __init__(self) -> None:
        self._current: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self._last: dict[tuple[str, str], Fraction] = {}
        self.steps_closed = 0

    def record(self, op: str, payload_bytes: int, group_size: int, dim: str, phase: str):
        wire = Fraction(_FACTOR[op] * (group_size - 1) * payload_bytes, group_size)
        self._current[_key(dim, phase)] += wire

    def record_sent(self, payload_bytes: int, dim: str, phase: str) -> None:
        """A point-to-point send (a pipeline stage's activations or their gradients):
        its bytes as they are, no collective's cost model."""
        self._current[_key(dim, phase)] += payload_bytes

    def close_step(self) -> None:
        """End the step: its counts become ``last_step`` and a new step starts at zero."""
        self._last = dict(self._current)
        self._current = defaultdict(Fraction)
        self.steps_closed += 1

    @staticmethod
    def _view(counts, dim, phase) -> Fraction:
        return sum(
            (v for (d, p), v in counts.items()
             if (dim is None or d == dim) and (phase is None or p == phase)),
            Fraction(0),
        )

    def last_step(self, dim: str | None = None, phase: str | None = None) -> Fraction:
        """Bytes of the last closed step, optionally filtered by dim and/or phase."""
        return self._view(self._last, dim, phase)

    def current(self, dim: str | None = None, phase: str | None = None) -> Fraction:
        return self._view(self._current, dim, phase)

    def last_step_by_phase(self) -> dict[str, dict[str, float]]:
        """``{dim: {phase: bytes}}`` of the last closed step, for metric records."""
        out: dict[str, dict[str, float]] = {}
        for (d, p), v in sorted(self._last.items()):
            out.setdefault(d, {})[p] = int(v) if v.denominator == 1 else float(v)
        return out


class Issued:
    """What one ``Streams.issuing`` block enqueued on its side stream: on CUDA an event
    recorded at the block's end, on the CPU nothing. Its consumer waits for it whether
    or not a collective went out: a group of one rank sends nothing, but its copy into
    the packed buffer still ran on the side stream."""

    def __init__(self, on_stream: bool = False):
        self.on_stream, self.event = on_stream, None

    def wait(self) -> None:
        """The current stream waits for the side stream's work (kept: a second consumer
        on another stream must wait too)."""
        if self.event is not None:
            self.event.wait()


class Pending:
    """An issued collective, the side-stream work around it (``issued``) and the buffers
    it reads or writes, kept alive until it is waited for (on CUDA the caching allocator
    may otherwise hand their memory to the compute stream while the side stream still
    uses it)."""

    def __init__(self, work, *buffers, issued: Issued | None = None):
        self.work, self.buffers = work, buffers
        self.issued = issued or Issued()

    def done(self) -> bool:
        """True once waiting costs nothing: on a CUDA stream the wait only orders
        streams; on the CPU the work must have finished."""
        return self.work is None or self.issued.on_stream or self.work.is_completed()

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()  # NCCL: the current stream waits; gloo: the thread blocks
            self.work = None
        self.issued.wait()


class Streams:
    """Where collectives are issued. On CUDA, parameter gathers and gradient reduces each
    get a stream of their own, which first waits for the compute stream so that their
    inputs are ready; consumers wait for the work and for an event recorded after it on
    the side stream (``Issued``), which orders the compute stream after both without
    blocking the CPU. On the CPU gloo runs async work on its own threads: no streams,
    and nothing here touches ``torch.cuda``."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._streams = {}
        if self.cuda:
            self._streams = {kind: torch.cuda.Stream(device) for kind in ("gather", "reduce")}

    @contextlib.contextmanager
    def issuing(self, kind: str):
        """Run the block on ``kind``'s side stream; yields the ``Issued`` its consumer's
        ``Pending`` waits for."""
        stream = self._streams.get(kind)
        if stream is None:
            yield Issued()
            return
        issued = Issued(on_stream=True)
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            yield issued
        issued.event = stream.record_event()


def one_launch(tensor: torch.Tensor) -> bool:
    """Whether the backend runs an uneven collective as one coalesced launch (NCCL, on
    CUDA tensors), rather than as point collectives on its threads (gloo)."""
    return tensor.is_cuda


def wait(work) -> None:
    """Wait for a collective these functions returned (None: nothing was sent)."""
    if work is not None:
        work.wait()


def _size(group) -> int:
    return dist.get_world_size(group)


def _all_reduce(tensor: torch.Tensor, group, ledger: Ledger, dim: str, phase: str, op):
    n = _size(group)
    ledger.record("all_reduce", tensor.numel() * tensor.element_size(), n, dim, phase)
    if n == 1:
        return None
    return dist.all_reduce(tensor, group=group, op=op, async_op=True)


def all_reduce_sum(tensor: torch.Tensor, group, ledger: Ledger, dim: str, phase: str):
    return _all_reduce(tensor, group, ledger, dim, phase, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor, group, ledger: Ledger, dim: str, phase: str):
    return _all_reduce(tensor, group, ledger, dim, phase, dist.ReduceOp.MAX)


class _Works:
    """Several async point collectives waited for as one; ``then`` runs after them."""

    def __init__(self, works, then=None):
        self.works, self.then = works, then

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        if self.then is not None:
            self.then()
            self.then = None
        return True


def all_of(works):
    """Several issued collectives as one work (None where none sent anything)."""
    works = [w for w in works if w is not None]
    return _Works(works) if works else None


def all_gather_v(out: torch.Tensor, sizes: list[int], mine: torch.Tensor, group,
                 ledger: Ledger, dim: str, phase: str):
    """Async gather of every rank's segment (``sizes[i]`` elements from group rank i,
    this rank's being ``mine``) into the flat ``out``, in group-rank order.

    NCCL runs an all-gather with uneven sizes as broadcasts coalesced into one launch
    (pytorch PR 83713), and equal sizes as one all-gather in place. Given a list of
    equal parts, ProcessGroupNCCL would gather into a temporary the size of ``out`` and
    copy it back, so equal sizes take the into-tensor form. Gloo has no coalescing and
    refuses uneven all-gathers; one async broadcast per source, issued back to back and
    run on gloo's threads, measured faster here than gloo's all-to-all (and than a
    padded all-gather) for the same bytes.
    """
    n = _size(group)
    ledger.record("all_gather", out.numel() * out.element_size(), n, dim, phase)
    parts = list(out.split(sizes))
    me = dist.get_rank(group)
    if parts[me].data_ptr() != mine.data_ptr():
        parts[me].copy_(mine)
    if n == 1:
        return None
    if one_launch(out):
        if len(set(sizes)) == 1:
            return dist.all_gather_into_tensor(out, parts[me], group=group, async_op=True)
        return dist.all_gather(parts, parts[me], group=group, async_op=True)
    return _Works([dist.broadcast(parts[i], group=group, group_src=i, async_op=True)
                   for i in range(n) if sizes[i]])


def reduce_scatter_v(out: torch.Tensor, full: torch.Tensor, sizes: list[int], group,
                     ledger: Ledger, dim: str, phase: str):
    """Async sum of ``full`` over the group, segment i (``sizes[i]`` elements) landing on
    group rank i as ``out``. SUM, with the caller dividing, because gloo's AVG is
    unreliable (pytorch issue 162338). NCCL: one uneven reduce-scatter (coalesced
    reduces), or for equal sizes the into-tensor form, which reads ``full`` as it is
    (given a list of equal parts, ProcessGroupNCCL copies them into a temporary the size
    of ``full`` first). Gloo: one async reduce per destination, which measured 1.5-1.7x
    faster here than gloo's uneven reduce-scatter; ``full`` is scratch afterwards (gloo
    leaves partial sums in it)."""
    n = _size(group)
    ledger.record("reduce_scatter", full.numel() * full.element_size(), n, dim, phase)
    parts = list(full.split(sizes))
    me = dist.get_rank(group)
    if n == 1:
        out.copy_(full)
        return None
    if one_launch(out):
        if len(set(sizes)) == 1:
            return dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group,
                                              async_op=True)
        return dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group,
                                   async_op=True)
    works = [dist.reduce(parts[i], group=group, group_dst=i, op=dist.ReduceOp.SUM,
                         async_op=True) for i in range(n) if sizes[i]]
    return _Works(works, then=lambda: out.copy_(parts[me]))
