"""Per-parameter precision from ``dedicate_params(param_policy=...)``: the dtype fields of
each param's ``DMuonParamPolicy`` (``dmuon.routing``), applied with FSDP2's meaning.

- Dedicated params (routes ``muon``, ``adamw``): per hook boundary, one ``param_dtype``
  (its packed buffer, gathers and forward) and one ``grad_dtype`` (its gradient buffers
  and reduce), so every param of a boundary must agree; ``output_dtype`` and
  ``cast_forward_inputs`` cast the boundary module's floating outputs and inputs, as
  FSDP2's ``MixedPrecisionPolicy`` does for a module.
- ``sharded_adamw`` params (FSDP2's): ``dmuon.fully_shard`` gives the module FSDP2's
  ``MixedPrecisionPolicy`` built from their policies (``grad_dtype`` as its
  ``reduce_dtype``) when it is passed none.

``master_dtype`` and ``optim_dtype`` keep the param's own dtype (masters and optimizer
state stay in it); another is refused, as is ``muon_forward_unshard="all_gather"``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map

POLICY_ATTR = "_dmuon_policy"  # on a sharded_adamw param until FSDP2 takes it over
_BOUNDARY_FIELDS = ("param_dtype", "grad_dtype", "output_dtype", "cast_forward_inputs")


def check_precision(name: str, param, policy) -> None:
    """Refuse what the param's storage cannot follow (see the module docstring)."""
    for field in ("master_dtype", "optim_dtype"):
        if getattr(policy, field) not in (None, param.dtype):
            raise ValueError(f"'{name}': {field}={getattr(policy, field)} differs from the "
                             f"param's {param.dtype}; masters and optimizer state keep the "
                             "param's own dtype here (cast the model first)")
    if policy.muon_forward_unshard != "broadcast":
        raise ValueError(f"'{name}': muon_forward_unshard={policy.muon_forward_unshard!r} is "
                         "not supported: the forward is one uneven all-gather per boundary")


def uses_precision(policies: dict) -> bool:
    """Whether any policy sets a dtype or a cast (then it is DMuon's own policy)."""
    return any(getattr(p, f) not in (None, False) for p in policies.values()
               for f in _BOUNDARY_FIELDS)


def boundary_precision(entries: list[tuple], policies: dict) -> dict[str, tuple]:
    """Boundary -> (param_dtype, grad_dtype, output_dtype, cast_forward_inputs), from the
    dedicated params' ``(fqn, shape, boundary)`` entries; refused where a boundary's
    params disagree (one packed buffer, one module)."""
    out: dict[str, tuple] = {}
    for fqn, _, boundary in entries:
        policy = policies.get(fqn)
        if policy is None:
            continue
        fields = tuple(getattr(policy, f) for f in _BOUNDARY_FIELDS)
        if out.setdefault(boundary, fields) != fields:
            raise ValueError(
                f"hook boundary '{boundary}': '{fqn}' has precision {fields}, another "
                f"param {out[boundary]} (param_dtype, grad_dtype, output_dtype, "
                "cast_forward_inputs); one boundary has one: give the module a boundary of "
                "its own (hook_boundary_predicate)")
    return out


def _caster(dtype):
    return lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def install_casts(module: nn.Module, param_dtype, output_dtype, cast_inputs: bool) -> None:
    """FSDP2's module casts: floating inputs to ``param_dtype``, outputs to
    ``output_dtype``."""
    if cast_inputs and param_dtype is not None:
        cast = _caster(param_dtype)
        module.register_forward_pre_hook(
            lambda m, args, kwargs: (tree_map(cast, args), tree_map(cast, kwargs)),
            with_kwargs=True)
    if output_dtype is not None:
        cast = _caster(output_dtype)
        module.register_forward_hook(lambda m, args, out: tree_map(cast, out))


def fsdp_policy(modules: tuple, given):
    """FSDP2's ``MixedPrecisionPolicy`` for ``fully_shard(modules)`` from the policies of
    the sharded_adamw params it takes over; ``given`` (the caller's) when they set none,
    refused when it differs from theirs or they disagree."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    found = {tuple(getattr(getattr(p, POLICY_ATTR), f) for f in _BOUNDARY_FIELDS)
             for m in modules for p in m.parameters() if hasattr(p, POLICY_ATTR)}
    found.discard((None, None, None, False))
    if not found:
        return given
    if len(found) > 1:
        raise ValueError(f"fully_shard: the params of one module have different precision "
                         f"policies {sorted(map(str, found))}; shard them separately")
    param_dtype, grad_dtype, output_dtype, cast = found.pop()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=grad_dtype,
                                  output_dtype=output_dtype, cast_forward_inputs=cast)
    if given is not None and given != policy:
        raise ValueError(f"fully_shard(mp_policy={given}) differs from the param_policy's "
                         f"{policy} for its params")
    return policy
