"""Pure-DMuon routing: which path each parameter that ``predicate`` selects takes, decided
by ``dedicate_params(param_policy=..., param_policy_fn=..., route_hint_fn=...)`` while
the full tensor is still there.

- ``"muon"``: dedicated to an owner (all-gather from the owners, reduce to them), Muon
  with Newton-Schulz on the owner. A 2-D matrix or a 3-D stack of experts.
- ``"adamw"``: dedicated the same way, stepped by AdamW on the owner's master: a norm or
  a bias without FSDP2's small collectives.
- ``"sharded_adamw"``: left to FSDP2, which is exactly an all-gather and a
  reduce-scatter over shards with AdamW on each shard (embeddings, the head).

The policy's semantics are the reference implementation's (its guide
"Pure DMuon Routing" and its ``dedicate_params`` docstring): ``defaults``,
then the ordered ``overrides`` whose ``name`` tokens (``contains``, the legacy alias)
occur in the parameter's full name, each setting only its ``set`` fields; a missing
route is ``"muon"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import nn

from .precision import check_precision

ROUTES = ("muon", "adamw", "sharded_adamw")
ROUTE_ATTR = "_dmuon_route"
DTYPE_FIELDS = ("param_dtype", "grad_dtype", "output_dtype", "master_dtype", "optim_dtype")
_OVERRIDE_KEYS = ("name", "contains", "set")
_UNSHARD = ("broadcast", "all_gather")


@dataclasses.dataclass(frozen=True)
class DMuonParamPolicy:
    """One parameter's final route and precision policy. ``param_dtype``: the forward's
    parameter and its all-gather (FSDP2's meaning); ``grad_dtype``: gradient buffers and
    their reduce; ``output_dtype``/``cast_forward_inputs``: casts at the hook boundary;
    ``master_dtype``/``optim_dtype``: the owner's master and its optimizer math.
    ``matched``: the indices of the overrides that applied (for summaries)."""

    route: str = "muon"
    param_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = False
    master_dtype: torch.dtype | None = None
    optim_dtype: torch.dtype | None = None
    muon_forward_unshard: str = "broadcast"
    matched: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), torch.dtype) else v)
                for f in dataclasses.fields(self)}


FIELDS = tuple(f.name for f in dataclasses.fields(DMuonParamPolicy) if f.name != "matched")


def _checked_fields(fields, where: str) -> dict:
    """``fields`` (a mapping of policy fields) checked: known names, routes and dtypes."""
    if not isinstance(fields, Mapping):
        raise TypeError(f"{where} must be a mapping of policy fields, got {type(fields).__name__}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where} has unknown fields {unknown}; the fields are {list(FIELDS)}")
    out = dict(fields)
    if out.get("route") is None and "route" in out:
        out["route"] = "muon"  # the reference: a missing route is the default "muon"
    if "route" in out and out["route"] not in ROUTES:
        raise ValueError(f"{where}.route={out['route']!r} is not one of {list(ROUTES)}")
    for name in DTYPE_FIELDS:
        if out.get(name) is not None and not isinstance(out[name], torch.dtype):
            raise TypeError(f"{where}.{name} must be a torch.dtype or None, got {out[name]!r}")
    if "cast_forward_inputs" in out and not isinstance(out["cast_forward_inputs"], bool):
        raise TypeError(f"{where}.cast_forward_inputs must be a bool")
    if out.get("muon_forward_unshard", "broadcast") not in _UNSHARD:
        raise ValueError(f"{where}.muon_forward_unshard must be one of {list(_UNSHARD)}")
    return out


def _tokens(override: Mapping, where: str) -> tuple[str, ...]:
    extra = sorted(set(override) - set(_OVERRIDE_KEYS))
    if extra:
        raise ValueError(f"{where} has unknown keys {extra}; an override has 'name' (or the "
                         "legacy 'contains') and 'set'")
    if ("name" in override) == ("contains" in override):
        raise ValueError(f"{where} needs exactly one of 'name' or 'contains' (its alias)")
    tokens = override.get("name", override.get("contains"))
    tokens = (tokens,) if isinstance(tokens, str) else tuple(tokens)
    if not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ValueError(f"{where}.name must be a non-empty string or list of them")
    if "set" not in override:
        raise ValueError(f"{where} has no 'set' (the fields it changes)")
    return tokens


def structured_policy(policy: Mapping) -> Callable[[str, nn.Parameter], DMuonParamPolicy]:
    """``param_policy`` (``{"defaults": {...}, "overrides": [...]}``), checked at once,
    as a function of the parameter's name."""
    if not isinstance(policy, Mapping):
        raise TypeError(f"param_policy must be a mapping, got {type(policy).__name__}")
    extra = sorted(set(policy) - {"defaults", "overrides"})
    if extra:
        raise ValueError(f"param_policy has unknown keys {extra}; it has 'defaults' and "
                         "'overrides'")
    defaults = _checked_fields(policy.get("defaults") or {}, "param_policy.defaults")
    overrides = []
    for i, o in enumerate(policy.get("overrides") or ()):
        where = f"param_policy.overrides[{i}]"
        if not isinstance(o, Mapping):
            raise TypeError(f"{where} must be a mapping")
        overrides.append((_tokens(o, where), _checked_fields(o["set"], f"{where}.set")))

    def resolve(name: str, param) -> DMuonParamPolicy:
        fields, matched = dict(defaults), []
        for i, (tokens, changes) in enumerate(overrides):
            if any(t in name for t in tokens):
                fields.update(changes)
                matched.append(i)
        return DMuonParamPolicy(**fields, matched=tuple(matched))

    return resolve


def as_policy(value, name: str, where: str) -> DMuonParamPolicy:
    """What ``param_policy_fn`` or ``route_hint_fn`` returned for ``name``, as a policy:
    a ``DMuonParamPolicy``, a mapping of its fields, a route, or None (``"muon"``)."""
    if isinstance(value, DMuonParamPolicy):
        return DMuonParamPolicy(**_checked_fields(
            {f: getattr(value, f) for f in FIELDS}, f"{where}('{name}')"))
    if value is None or isinstance(value, str):
        value = {"route": value}
    return DMuonParamPolicy(**_checked_fields(value, f"{where}('{name}')"))


def resolve_policies(model: nn.Module, predicate, param_policy=None, param_policy_fn=None,
                     route_hint_fn=None) -> dict[str, DMuonParamPolicy]:
    """The policy of every parameter ``predicate`` selects, by name (empty without a
    policy: every selected matrix is Muon's, as before routing existed)."""
    given = [k for k, v in (("param_policy", param_policy), ("param_policy_fn", param_policy_fn),
                            ("route_hint_fn", route_hint_fn)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"dedicate_params takes one of param_policy, param_policy_fn and "
                         f"route_hint_fn, got {given}")
    if not given:
        return {}
    if param_policy is not None:
        resolve = structured_policy(param_policy)
    else:
        fn, where = (param_policy_fn, "param_policy_fn") if param_policy_fn is not None \
            else (route_hint_fn, "route_hint_fn")
        resolve = lambda n, p: as_policy(fn(n, p), n, where)  # noqa: E731
    out = {n: resolve(n, p) for n, p in model.named_parameters() if predicate(n, p)}
    for n, pol in out.items():
        check_route(n, model.get_parameter(n), pol)
    return out


def check_route(name: str, param: nn.Parameter, policy: DMuonParamPolicy) -> None:
    """Refuse what a route cannot do: Muon orthogonalises matrices (2-D, or 3-D stacks of
    experts) only; and precision the param's storage cannot follow
    (``dmuon.precision``)."""
    check_precision(name, param, policy)
    if policy.route == "muon" and param.ndim not in (2, 3):
        raise ValueError(
            f"'{name}' {tuple(param.shape)} is routed to 'muon', which orthogonalises 2-D "
            "matrices and 3-D (experts, out, in) stacks only: route it to 'adamw' (owner "
            "broadcast/reduce) or 'sharded_adamw' with an override, e.g. "
            "{'name': ['norm', '.bias'], 'set': {'route': 'adamw'}}")


def routed_predicate(predicate, policies: dict[str, DMuonParamPolicy]):
    """The params DMuon dedicates: ``predicate``'s, but those routed to FSDP2."""
    if not policies:
        return predicate
    return lambda n, p: predicate(n, p) and policies[n].route != "sharded_adamw"


def owner_adamw(policies: dict[str, DMuonParamPolicy]) -> frozenset[str]:
    """The params dedicated to an owner and stepped by AdamW there."""
    return frozenset(n for n, pol in policies.items() if pol.route == "adamw")


def param_route(param) -> str:
    """The optimizer route of a module param: a dedicated one's from its policy, else
    ``"sharded_adamw"`` (FSDP2's shards, or the DDP composition's replicas)."""
    return getattr(param, ROUTE_ATTR, "sharded_adamw")
