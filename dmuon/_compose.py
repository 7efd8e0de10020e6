"""Composition with FSDP2 and TP, installed by ``import dmuon``.

FSDP2's ``fully_shard`` leaves dedicated params alone, its gradient-sync switch drives
DMuon's reduce as well, and tensor parallelism applied after ``dedicate_params`` is
refused by name (its parallel styles would read the placeholders' freed storage).

The patch wraps the helper that ``fully_shard`` uses to collect a module's managed
params, rather than the ``fully_shard`` symbol itself: user code that imported
``fully_shard`` before ``import dmuon`` holds the original function, and still goes
through this helper. Dedicated params are added to FSDP2's own ``ignored_params``,
whose semantics (not sharded, gradients not reduced) are exactly what DMuon needs.
"""

from __future__ import annotations

import functools

from torch import nn

_PATCHED = "_dmuon_patched"


def _with_dedicated_ignored(get_modules_and_states):
    @functools.wraps(get_modules_and_states)
    def wrapper(module, device, ignored_params, *args, **kwargs):
        roots = (module,) if isinstance(module, nn.Module) else tuple(module)
        dedicated = {
            p for root in roots for p in root.parameters()
            if getattr(p, "_dmuon_dedicated", False)
        }
        if dedicated:
            ignored_params = set(ignored_params or ()) | dedicated
        return get_modules_and_states(module, device, ignored_params, *args, **kwargs)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def _with_dmuon_sync(set_requires_gradient_sync):
    """FSDP2's gradient-sync switch also switches DMuon's reduce for the same modules."""

    @functools.wraps(set_requires_gradient_sync)
    def wrapper(self, requires_gradient_sync, *, recurse=True):
        from .grads import set_gradient_sync

        set_requires_gradient_sync(self, requires_gradient_sync, recurse=recurse)
        set_gradient_sync(self, requires_gradient_sync, recurse)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def _refusing_dedicated(distribute_module):
    @functools.wraps(distribute_module)
    def wrapper(module, *args, **kwargs):
        for p in module.parameters():
            if getattr(p, "_dmuon_dedicated", False):
                raise RuntimeError(
                    f"tensor parallelism applied to '{p._dmuon_dedicated}' after "
                    "dmuon.dedicate_params; apply TP first, then dedicate_params, then "
                    "fully_shard"
                )
        return distribute_module(module, *args, **kwargs)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def install() -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fully_shard

    if not getattr(_fully_shard._get_modules_and_states, _PATCHED, False):
        _fully_shard._get_modules_and_states = _with_dedicated_ignored(
            _fully_shard._get_modules_and_states
        )
    from torch.distributed.tensor.parallel import style

    if not getattr(style.distribute_module, _PATCHED, False):
        style.distribute_module = _refusing_dedicated(style.distribute_module)
    if not getattr(FSDPModule.set_requires_gradient_sync, _PATCHED, False):
        FSDPModule.set_requires_gradient_sync = _with_dmuon_sync(
            FSDPModule.set_requires_gradient_sync
        )
