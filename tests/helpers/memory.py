"""Peak bytes a piece of code allocates on the CPU, where torch keeps no allocator stats.

A dispatch mode sees every ATen op; an op output whose storage no input shares is a new
allocation (views and in-place ops return an input's storage). Live bytes are summed over
those storages that are still alive, after every op: only op outputs allocate, so the
largest such sum is the peak of what the code allocated on top of what existed before.
Ops that tensor subclasses (DTensor) run on their local tensors are not seen; the code
measured here reaches DTensors only through views (``to_local``) and plain tensors.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> list:
    return [t.untyped_storage() for t in tree_flatten(tree)[0]
            if type(t) is torch.Tensor or type(t) is torch.nn.Parameter]


class PeakNewBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {StorageWeakRef(s).cdata for s in _storages((args, kwargs))}
        for s in _storages(out):
            ref = StorageWeakRef(s)
            if ref.cdata not in inputs and ref.cdata not in self.alive and s.nbytes():
                self.alive[ref.cdata] = (ref, s.nbytes())
        self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))
        return out


def peak_live_bytes(fn):
    """``(fn(), peak)``: the peak of live CPU tensor bytes ``fn`` allocated on top of what
    existed, from the profiler's allocation records (operators' own allocations and the
    free and storage-resize records, in time order). It sees what tensor subclasses
    allocate for their local tensors too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    deltas = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]"
                     else e.self_cpu_memory_usage) for e in prof.events())
    live = peak = 0
    for _, d in deltas:
        live += d
        peak = max(peak, live)
    return out, peak
