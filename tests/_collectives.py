"""Count torch.distributed collectives independently of DMuon's ledger."""

from __future__ import annotations

import torch.distributed as dist

_OPS = ("broadcast", "reduce", "all_reduce", "all_gather", "all_gather_into_tensor",
        "all_gather_single", "reduce_scatter_tensor", "reduce_scatter",
        "reduce_scatter_single")
_FIRST = ("tensor", "output", "output_tensor", "output_tensor_list")


class CollectiveRecorder:
    """Patches the collectives on ``torch.distributed``; records (op, numel, bytes, n)."""

    def __init__(self):
        self.calls: list[tuple[str, int, int, int]] = []
        self._saved = {}

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            n = dist.get_world_size(kwargs.get("group"))
            t = args[0] if args else next(kwargs[k] for k in _FIRST if k in kwargs)
            t = t[0] if isinstance(t, (list, tuple)) else t
            self.calls.append((name, t.numel(), t.numel() * t.element_size(), n))
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
