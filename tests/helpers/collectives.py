"""Count torch.distributed collectives independently of DMuon's ledger."""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "all_gather_into_tensor",
        "all_gather_single", "reduce_scatter_tensor", "reduce_scatter",
        "reduce_scatter_single", "all_to_all_single")


def _tensors(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _payload(name, args, kwargs):
    """The tensor a collective moves in full: the whole gathered output, the whole input
    of a reduce-scatter, the one tensor of a broadcast, reduce or all-reduce."""
    if name == "reduce_scatter":
        full = _tensors(args[1] if len(args) > 1 else kwargs["input_list"])
    elif name == "reduce_scatter_tensor":
        full = _tensors(args[1] if len(args) > 1 else kwargs["input"])
    else:
        full = _tensors(args[0] if args else next(
            kwargs[k] for k in ("tensor", "output", "output_tensor", "output_tensor_list")
            if k in kwargs))
    return sum(t.numel() for t in full), sum(t.numel() * t.element_size() for t in full)


class Call(NamedTuple):
    op: str
    numel: int  # of the whole tensor moved (see ``_payload``)
    bytes: int
    n: int  # group size
    ranks: tuple  # the group's global ranks

    def wire(self) -> float:
        """Bytes per rank in the bandwidth-optimal model: (n-1)/n of the payload."""
        return self.bytes * (self.n - 1) / self.n


class CollectiveRecorder:
    """Patches the collectives on ``torch.distributed`` and records each ``Call``."""

    def __init__(self):
        self.calls: list[Call] = []
        self._saved = {}

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            self.calls.append(Call(name, *_payload(name, args, kwargs), len(ranks), ranks))
            return fn(*args, **kwargs)
        return wrapper

    def __enter__(self):
        for name in _OPS:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


class DMuonCollectives:
    """Records DMuon's logical collectives as its comm layer issues them: (function,
    dim, phase). One logical collective may be several point operations on gloo."""

    NAMES = ("all_gather_v", "reduce_scatter_v", "all_reduce_sum")

    def __init__(self, log: list | None = None):
        self.log = [] if log is None else log
        self._saved = {}

    def __enter__(self):
        import dmuon.comm

        for name in self.NAMES:
            real = getattr(dmuon.comm, name)
            self._saved[name] = real

            def wrapper(*args, _name=name, _real=real, **kwargs):
                dim, phase = args[-2:]
                self.log.append((_name, dim, phase))
                return _real(*args, **kwargs)

            setattr(dmuon.comm, name, wrapper)
        return self

    def __exit__(self, *exc):
        import dmuon.comm

        for name, fn in self._saved.items():
            setattr(dmuon.comm, name, fn)

    def take(self):
        log, self.log = list(self.log), []
        return log


class FuncolBytes(TorchDispatchMode):
    """Bytes per rank of every functional collective on one group, by the cost model
    (all-reduce 2(n-1)/n x S, all-gather and reduce-scatter (n-1)/n x S of the whole)."""

    def __init__(self, group):
        super().__init__()
        self.name, self.n, self.bytes = group.group_name, group.size(), 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and self.name in args:
            t = args[0]
            whole = {"all_reduce": 2 * t.nbytes, "all_gather_into_tensor": t.nbytes * self.n,
                     "reduce_scatter_tensor": t.nbytes}[op]
            self.bytes += whole * (self.n - 1) / self.n
        return out
