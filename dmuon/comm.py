"""Every collective DMuon issues, and the byte ledger that counts them.

Bytes follow the bandwidth-optimal cost model per rank: broadcast, reduce, all-gather
and reduce-scatter move (n-1)/n x S, all-reduce 2(n-1)/n x S, for a payload of S bytes
on a group of n ranks. Counts are exact (fractions) and kept per mesh dimension
(``shard``, ``replicate``, ``tp``) and phase (``forward``, ``backward``, ``reduce``,
``step``, ``replicate``, ``state_dict``, ``checkpoint``).

The collectives are looked up on ``torch.distributed`` at call time, so a test that
patches them sees every call.
"""

from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

import torch
import torch.distributed as dist

DIMS = ("shard", "replicate", "tp")
PHASES = ("forward", "backward", "reduce", "step", "replicate", "state_dict", "checkpoint")
_FACTOR = {"broadcast": 1, "reduce": 1, "all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


class Ledger:
    """Bytes per (mesh dim, phase) for the step in progress and the last closed step."""

    def __init__(self) -> None:
        self._current: dict[tuple[str, str], Fraction] = defaultdict(Fraction)
        self._last: dict[tuple[str, str], Fraction] = {}
        self.steps_closed = 0

    def record(self, op: str, payload_bytes: int, group_size: int, dim: str, phase: str):
        if dim not in DIMS or phase not in PHASES:
            raise ValueError(f"unknown ledger key dim={dim!r} phase={phase!r}")
        wire = Fraction(_FACTOR[op] * (group_size - 1) * payload_bytes, group_size)
        self._current[(dim, phase)] += wire

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


class _Done:
    """A finished handle, for collectives that need no communication (group of 1)."""

    def wait(self) -> bool:
        return True


def _size(group) -> int:
    return dist.get_world_size(group)


def broadcast(tensor: torch.Tensor, src: int, group, ledger: Ledger, dim: str, phase: str):
    """Async broadcast from group rank ``src``; returns a handle with ``wait()``."""
    n = _size(group)
    ledger.record("broadcast", tensor.numel() * tensor.element_size(), n, dim, phase)
    if n == 1:
        return _Done()
    return dist.broadcast(tensor, group=group, group_src=src, async_op=True)


def reduce_sum(tensor: torch.Tensor, dst: int, group, ledger: Ledger, dim: str, phase: str):
    """Async sum-reduce to group rank ``dst``.

    SUM then an explicit divide by the caller, because gloo's AVG is unreliable
    (pytorch issue 162338). Non-destination ranks are left with partial sums.
    """
    n = _size(group)
    ledger.record("reduce", tensor.numel() * tensor.element_size(), n, dim, phase)
    if n == 1:
        return _Done()
    return dist.reduce(tensor, group=group, group_dst=dst, op=dist.ReduceOp.SUM, async_op=True)


def all_reduce_sum(tensor: torch.Tensor, group, ledger: Ledger, dim: str, phase: str):
    n = _size(group)
    ledger.record("all_reduce", tensor.numel() * tensor.element_size(), n, dim, phase)
    if n == 1:
        return _Done()
    return dist.all_reduce(tensor, group=group, op=dist.ReduceOp.SUM, async_op=True)
