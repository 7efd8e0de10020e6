"""The spec's ``dmuon.param_policy`` applied to a model: every param's route and policy,
resolved by the core (``dmuon.planning.resolve_policies``, the rule
``dmuon.dedicate_params`` applies), and the param split that follows, the one the
planner partitions and the workers dedicate (so the stored plan is the plan that runs).

- ``"muon"`` and ``"adamw"``: dedicated to an owner (the split's predicate); the AdamW
  ones are planned with no Newton-Schulz FLOPs.
- ``"sharded_adamw"``: left to FSDP2, which steps them with AdamW on its shards; the
  dtypes the policy sets for them are FSDP2's ``mp_policy`` for the ``fully_shard``
  that takes them (the core's rule), else the spec's ``precision`` is, so the two are
  not both given.

A dedicated param outside every hook boundary (the final norm, called after the
blocks) gets its own module as one, as the reference's guide advises for terminal
modules.
"""

from __future__ import annotations

from torch import nn

from dmuon import planning

from ..spec import JobSpec
from ..spec.policy_section import ParamPolicySpec
from .dtypes import DTYPES
from .params import ParamRuleError, ParamSplit, _owning_block, _with_expert_boundaries

DTYPE_FIELDS = ("param_dtype", "grad_dtype", "output_dtype", "master_dtype", "optim_dtype")
NAMES = {v: k for k, v in DTYPES.items()}


def _torch_fields(given: dict) -> dict:
    return {k: DTYPES[v] if k in DTYPE_FIELDS and v is not None else v
            for k, v in given.items()}


def torch_policy(policy: ParamPolicySpec) -> dict:
    """``dmuon.dedicate_params``'s ``param_policy``: the spec's, dtypes as torch's."""
    plain = policy.as_dict()
    return {"defaults": _torch_fields(plain["defaults"]),
            "overrides": [{"name": o["name"], "set": _torch_fields(o["set"])}
                          for o in plain["overrides"]]}


def route_entry(policy) -> dict:
    """A resolved ``dmuon.DMuonParamPolicy`` as the plan stores it: dtypes by the spec's
    names (null: not set, the param's own), ``matched``: the overrides that applied."""
    return {"route": policy.route,
            **{f: NAMES.get(getattr(policy, f)) for f in DTYPE_FIELDS},
            "cast_forward_inputs": policy.cast_forward_inputs,
            "muon_forward_unshard": policy.muon_forward_unshard,
            "matched": list(policy.matched)}


def _boundaries(model: nn.Module, given: list[str], dedicated: list[str]) -> list[str]:
    """``given``, and the module of each dedicated param that lies in none, in module
    order."""
    outside = {n.rpartition(".")[0] for n in dedicated if _owning_block(n, given) is None}
    keep = set(given) | outside
    return [n for n, _ in model.named_modules() if n in keep]


def _check_fsdp_dtypes(resolved: dict, spec: JobSpec) -> None:
    sharded = [n for n, pol in resolved.items() if pol.route == "sharded_adamw" and
               any(getattr(pol, f) is not None for f in ("param_dtype", "grad_dtype",
                                                         "output_dtype"))]
    if sharded and spec.precision.mixed:
        raise ParamRuleError(
            f"dmuon.param_policy: sets the dtypes of sharded_adamw params ('{sharded[0]}'), "
            "which FSDP2 runs, and precision sets FSDP2's mixed precision too; give them "
            "in one of the two")


def routed_split(model: nn.Module, split: ParamSplit, spec: JobSpec) -> ParamSplit:
    """``split`` (the derived rule's blocks and boundaries) with the policy's routes; a
    policy the model refuses (a 1-D param routed to Muon, a master dtype the params are
    not built in) is a ``ParamRuleError`` naming ``dmuon.param_policy``."""
    param_policy = torch_policy(spec.dmuon.param_policy)
    try:
        resolved = planning.resolve_policies(model, lambda n, p: True, param_policy)
    except (TypeError, ValueError) as e:
        raise ParamRuleError(f"dmuon.param_policy: {e}") from None
    _check_fsdp_dtypes(resolved, spec)
    by_route: dict[str, list[str]] = {"muon": [], "adamw": [], "sharded_adamw": []}
    for name, pol in resolved.items():
        by_route[pol.route].append(name)
    if not by_route["muon"] and not by_route["adamw"]:
        raise ParamRuleError("dmuon.param_policy: routes every param to sharded_adamw; "
                             "DMuon would dedicate nothing")
    blocks = split.fsdp_units
    boundaries = split.boundaries if spec.dmuon.hook_boundaries is not None else \
        _with_expert_boundaries(model, blocks, by_route["muon"])
    dedicated = [n for n in resolved if resolved[n].route != "sharded_adamw"]
    adamw = [n for n in resolved if resolved[n].route != "muon"]
    routed = ParamSplit(
        muon=by_route["muon"], adamw=adamw, fsdp_units=blocks,
        boundaries=_boundaries(model, boundaries, dedicated),
        reasons={n: f"dmuon.param_policy: {resolved[n].route}" for n in adamw},
        owner_adamw=by_route["adamw"], param_policy=param_policy,
        routes={n: route_entry(pol) for n, pol in resolved.items()})
    return routed
