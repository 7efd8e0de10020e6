"""Composition with FSDP2 through its public API.

Dedicated params reach FSDP2 as ``ignored_params`` (not sharded, gradients not reduced:
exactly what DMuon needs), either through the drop-in ``dmuon.fully_shard`` or by passing
``ignored_params=dmuon.ignored_params(model)`` to ``torch.distributed.fsdp.fully_shard``.
No FSDP2 function is replaced. The drop-in also hands FSDP2's ``mp_policy`` to DMuon,
so one mixed-precision policy covers both kinds of params.

One public torch function is wrapped at import, tensor parallelism's
``distribute_module``: applied after ``dedicate_params`` it would read the placeholders'
freed storage and fail with a storage-size error that names nothing; the wrapper
refuses by the param's name instead.
"""

from __future__ import annotations

import functools

from torch import nn

from .dedicate import is_dedicated


def fully_shard(module, *, ignored_params: set | None = None, **kwargs):
    """``torch.distributed.fsdp.fully_shard`` with ``module``'s dedicated params added to
    ``ignored_params``; a ``mp_policy`` also becomes DMuon's for the boundaries inside.
    Takes every other argument of FSDP2's ``fully_shard`` and returns what it returns."""
    from torch.distributed.fsdp import fully_shard as fsdp_fully_shard

    modules = (module,) if isinstance(module, nn.Module) else tuple(module)
    dedicated = {p for m in modules for p in m.parameters() if is_dedicated(p)}
    policy = kwargs.get("mp_policy")
    if dedicated and policy is not None:
        state = next(iter(dedicated))._dmuon_owner_state
        state.adopt_mp_policy(policy)
    return fsdp_fully_shard(module, ignored_params=set(ignored_params or ()) | dedicated, **kwargs)



def _refusing_dedicated(distribute_module):
    @functools.wraps(distribute_module)
    def wrapper(module, *args, **kwargs):
        for p in module.parameters():
            if is_dedicated(p):
                raise RuntimeError(
                    f"tensor parallelism applied to '{p._dmuon_dedicated}' after "
                    "dmuon.dedicate_params; apply TP first, then dedicate_params, then "
                    "fully_shard")
        return distribute_module(module, *args, **kwargs)

    wrapper._dmuon_guard = True
    return wrapper


def guard_tensor_parallel() -> None:
    from torch.distributed.tensor.parallel import style

    if not getattr(style.distribute_module, "_dmuon_guard", False):
        style.distribute_module = _refusing_dedicated(style.distribute_module)
