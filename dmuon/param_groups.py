"""``dmuon.Muon``'s param groups: the three ways a user gives them (the model,
torch-style groups, the reference's named groups), split into Muon groups of dedicated
params and AdamW groups of the rest, and every option checked where it is given."""

from __future__ import annotations

from torch import nn

from .model_state import DedicatedModel, get_state, is_dedicated
from .newton_schulz import coefficient_schedule
from .ns_backends import group_options
from .routing import ROUTES, param_route

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "ns_backend",
              "ns_coefficients", "ns_dtype", "ns_gram_dtype", "eps", "adjust_lr_fn",
              "variant", "beta2", "group_name", "ns_restart")
VARIANTS = ("muon", "normuon")
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "group_name")
# the reference's named groups: key -> (the Muon or AdamW option it sets, fallback keys)
_NAMED_GROUP_KEYS = {
    "muon": {"lr": ("muon_lr", "lr"), "weight_decay": ("muon_weight_decay", "weight_decay"),
             "momentum": ("momentum",)},
    "adamw": {"lr": ("adamw_lr", "lr"), "weight_decay": ("adamw_weight_decay", "weight_decay"),
              "betas": ("adamw_betas",), "eps": ("adamw_eps",)},
}
# a user group's explicit route for its DMuon-managed params (the reference's three names)
ROUTE_KEYS = ("dmuon_route", "dmuon_optimizer", "matrix_optimizer")
_NAMED_GROUP_EXTRA = ("params", "group_name", "name", *ROUTE_KEYS)


def named_groups(model: nn.Module, param_groups) -> list[dict]:
    """The reference's ``param_groups=[{"params": [...], "lr": ..., "group_name": ...}]``
    over the model's params as torch-style groups: each named group becomes a Muon group
    of its dedicated params and an AdamW group of the rest (``<name>/muon``,
    ``<name>/adamw``); ``muon_lr``/``adamw_lr``, ``muon_weight_decay``/
    ``adamw_weight_decay`` override the group's ``lr``/``weight_decay`` per kind, which
    override the constructor's. Every trainable param must be in exactly one group."""
    allowed = {k for keys in _NAMED_GROUP_KEYS.values() for ks in keys.values() for k in ks}
    out, seen = [], {}
    for i, g in enumerate(param_groups):
        extra = sorted(set(g) - allowed - set(_NAMED_GROUP_EXTRA))
        if extra:
            raise ValueError(f"dmuon.Muon: param_groups[{i}] does not take {extra}; its keys "
                             f"are {sorted(allowed | set(_NAMED_GROUP_EXTRA))}")
        if "params" not in g:
            raise ValueError(f"dmuon.Muon: param_groups[{i}] has no 'params'")
        name = g.get("group_name", g.get("name", f"group_{i}"))
        params = list(g["params"])
        for p in params:
            if id(p) in seen:
                raise ValueError(f"dmuon.Muon: a param is in param_groups {seen[id(p)]} and {i}")
            seen[id(p)] = i
        forced = forced_route(g, i)
        for kind, keys in _NAMED_GROUP_KEYS.items():
            chosen = [p for p in params if param_kind(p, forced, i) == kind]
            options = {opt: next(g[k] for k in ks if k in g) for opt, ks in keys.items()
                       if any(k in g for k in ks)}
            if forced is not None:
                options["dmuon_route"] = forced
            if chosen:
                out.append({"params": chosen, **options, "group_name": f"{name}/{kind}"})
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"dmuon.Muon: param_groups leave out {missing[:4]} ({len(missing)} "
                         "trainable params); put every trainable param in a group")
    return out


def user_groups(params, param_groups=None) -> tuple[list[dict], DedicatedModel]:
    """torch-style groups over module params (or the reference's named groups over the
    model's), and the DMuon state they belong to."""
    if param_groups is not None:
        if not isinstance(params, nn.Module):
            raise TypeError("dmuon.Muon(model, param_groups=[...]): named param groups "
                            "go with the model as the first argument")
        groups, state = named_groups(params, param_groups), get_state(params)
        return user_groups(groups)[0], state
    if isinstance(params, nn.Module):
        trainable = [p for p in params.parameters() if p.requires_grad]
        groups = [{"params": [p for p in trainable if param_route(p) == "muon"]},
                  {"params": [p for p in trainable if param_route(p) != "muon"]}]
        return groups, get_state(params)
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    state = None
    for g in groups:
        g["params"] = list(g["params"])
        for p in g["params"]:
            state = state or getattr(p, "_dmuon_owner_state", None)
    if state is None:
        raise ValueError("dmuon.Muon needs a model prepared with dmuon.dedicate_params, or "
                         "param groups containing at least one of its dedicated params")
    return groups, state

def split_groups(user_groups: list[dict], muon_defaults: dict, adamw_defaults: dict,
                 state: DedicatedModel) -> tuple[list[dict], list[dict]]:
    """Muon groups over this rank's masters (the owned matrices of the group's
    dedicated params) and AdamW groups over the rest, each completed by the defaults."""
    muon, adamw = [], []
    for i, g in enumerate(user_groups):
        forced = forced_route(g, i)
        options = {k: v for k, v in g.items() if k != "params" and k not in ROUTE_KEYS}
        params = _owned_or_shards(g["params"], state)
        if group_kind(i, g["params"], forced) == "adamw":
            adamw.append({**adamw_defaults, **only(options, ADAMW_KEYS, i, "AdamW"),
                          "params": params, "dmuon_route": "adamw"})
            continue
        options = only({**muon_defaults, **options}, MUON_KEYS, i, "Muon")
        check_args(options)
        muon.append({**options, "params": params, "kind": "muon", "use_muon": True,
                     "dmuon_route": "muon"})
    return muon, adamw


def _owned_or_shards(params, state: DedicatedModel) -> list:
    """What the optimizer steps for ``params``: this rank's masters of the dedicated
    ones (none where it owns none), the others themselves (FSDP2's shards)."""
    wanted = {p._dmuon_dedicated for p in params if is_dedicated(p)}
    masters = [t for fqn, t in state.owned_params.items()
               if state.plan.params[fqn].param in wanted]
    return [p for p in params if not is_dedicated(p)] + masters


def forced_route(group: dict, index: int) -> str | None:
    """A user group's explicit route (``dmuon_route``, ``dmuon_optimizer`` or
    ``matrix_optimizer``), None when it sets none."""
    given = {k: group[k] for k in ROUTE_KEYS if group.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ValueError(f"dmuon.Muon: param group {index} sets different routes {given}")
    route = next(iter(given.values()), None)
    if route is not None and route not in ROUTES:
        raise ValueError(f"dmuon.Muon: param group {index} route {route!r} is not one of "
                         f"{list(ROUTES)}")
    return route


def param_kind(p, forced: str | None, index: int) -> str:
    """``"muon"`` or ``"adamw"``: the optimizer that steps ``p``, by its route from
    ``dedicate_params`` unless its group forces one. A group cannot move a param between
    an owner and FSDP2's shards: that storage was laid out by ``dedicate_params``."""
    route = param_route(p)
    if forced is None or forced == route:
        return "muon" if route == "muon" else "adamw"
    where = f"dmuon.Muon: param group {index} forces dmuon_route={forced!r} on "
    if forced == "sharded_adamw" and is_dedicated(p):
        raise ValueError(where + f"'{p._dmuon_dedicated}', which dedicate_params gave an owner;"
                         " route it to 'sharded_adamw' in dedicate_params(param_policy=...)")
    if forced == "muon" and (not is_dedicated(p) or p.ndim not in (2, 3)):
        raise ValueError(where + "a param that is not a dedicated matrix (FSDP2's, or not "
                         "2-D/3-D); route it to 'muon' in dedicate_params(param_policy=...)")
    return "muon" if forced == "muon" else "adamw"


def group_kind(index: int, params, forced: str | None = None) -> str:
    kinds = {param_kind(p, forced, index) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"dmuon.Muon: param group {index} mixes dedicated (Muon) params "
                         "with others (AdamW: FSDP2's, or routed to 'adamw'); put them in "
                         "separate groups")
    return kinds.pop() if kinds else "adamw"


def only(options: dict, allowed, index: int, kind: str) -> dict:
    extra = sorted(set(options) - set(allowed))
    if extra:
        raise ValueError(f"dmuon.Muon: param group {index} ({kind}) does not take {extra}; "
                         f"its options are {list(allowed)}")
    return options


def check_adamw_args(o: dict) -> None:
    for name in ("lr", "weight_decay"):
        if not o[name] >= 0:
            raise ValueError(f"dmuon.Muon: adamw_{name} must be >= 0, got {o[name]}")


def check_args(o: dict) -> None:
    for name in ("lr", "momentum", "weight_decay"):
        if not o[name] >= 0:
            raise ValueError(f"dmuon.Muon: {name} must be >= 0, got {o[name]}")
    if not (isinstance(o["ns_steps"], int) and 0 < o["ns_steps"] < 100):
        raise ValueError(f"dmuon.Muon: ns_steps must be an int in [1, 99], got {o['ns_steps']}")
    if o["variant"] not in VARIANTS:
        raise ValueError(f"dmuon.Muon: variant={o['variant']!r} is not one of {list(VARIANTS)}")
    if not 0 <= o["beta2"] < 1:
        raise ValueError(f"dmuon.Muon: beta2 must be in [0, 1), got {o['beta2']}")
    if o["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"dmuon.Muon: adjust_lr_fn={o['adjust_lr_fn']!r} is not one of {list(ADJUST_LR_FNS)}"
        )
    o.update(group_options(o["ns_backend"]))  # a NewtonSchulz sets its schedule too
    coefficient_schedule(o["ns_coefficients"], o["ns_steps"])
