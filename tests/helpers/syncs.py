"""Count the host syncs code would make on CUDA, on the CPU where none of them waits.

A CUDA host sync is a device-to-host read the host must wait for. On the CPU they cost
nothing, so they are counted by what calls them:

- ATen ops seen by a dispatch mode: ``_local_scalar_dense`` (``.item()``, ``int(t)``,
  ``float(t)``, ``bool(t)``), ``nonzero`` (and ``torch.where`` of one argument),
  ``bincount`` (its CUDA kernel reads its input's min and max: counted as the 2 syncs it
  makes), ``repeat_interleave`` without ``output_size``, ``masked_select``, ``unique``
  and indexing by a boolean mask (a ``nonzero`` inside);
- Python methods that reach the host without an ATen op on a CPU tensor: ``.tolist()``,
  ``.cpu()``, ``.numpy()`` (each one copy to the host, so one sync on CUDA).

Ops that tensor subclasses (DTensor) run on their local tensors are seen as well, since a
dispatch mode sits below them.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATEN = {"_local_scalar_dense": 1, "nonzero": 1, "bincount": 2, "masked_select": 1,
         "_unique2": 1, "unique_dim": 1, "unique_consecutive": 1}
_METHODS = ("tolist", "cpu", "numpy")


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as s: ...`` then ``s.total`` and ``s.by_kind``."""

    def __init__(self):
        super().__init__()
        self.by_kind: collections.Counter = collections.Counter()
        self._saved = {}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in _ATEN:
            self.by_kind[name] += _ATEN[name]
        elif func is torch.ops.aten.repeat_interleave.Tensor and \
                kwargs.get("output_size") is None:
            self.by_kind["repeat_interleave"] += 1
        elif name in ("index", "index_put", "index_put_") and _bool_index(args):
            self.by_kind["bool_index"] += 1
        return func(*args, **kwargs)

    def _wrap(self, name):
        original = self._saved[name]

        def counted(tensor, *args, **kwargs):
            self.by_kind[name] += 1
            return original(tensor, *args, **kwargs)
        return counted

    def __enter__(self):
        for name in _METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)
        self._saved.clear()
        return super().__exit__(*exc)
