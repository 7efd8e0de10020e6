"""The reference implementation's diagnostics: ``summarize_param_groups``,
``summarize_comm_plan``, ``get_comm_ctx`` (``DedicatedCommContext``) and
``collect_forward_unshard_profile``. Rank-local and JSON-friendly (dtypes as strings);
none issues a collective. Counts that say ``all`` cover every rank's params (from the
plan every rank shares); the rest are this rank's facts."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .fqn import params_by_name
from .model_state import STATE_ATTR, get_state, is_dedicated

_ROUTES = ("muon", "adamw", "sharded_adamw")


def _dtype(d) -> str | None:
    return None if d is None else str(d)


def _route_of(state, name: str, param) -> str:
    if is_dedicated(param):
        return state.plan.params[state.plan.param_fqns[param._dmuon_dedicated][0]].route
    return "sharded_adamw"  # FSDP2's shards (the policy's route, or left out of DMuon)


def _run_dtypes(state, param, policy) -> tuple:
    """(param_dtype, grad_dtype) as the param runs: a dedicated param's, its hook
    boundary's (packed buffer and reduce); an FSDP2 param's, its policy's (FSDP2 reduces
    in the param dtype unless given another), else its own and None."""
    if is_dedicated(param):
        units = state.plan.param_fqns[param._dmuon_dedicated]
        name = state.plan.params[units[0]].boundary
        b = next(b for b in state.boundaries if b.name == name)
        return b.param_dtype, b.reduce_dtype
    if policy is not None and policy.param_dtype is not None:
        return policy.param_dtype, policy.grad_dtype or policy.param_dtype
    return param.dtype, getattr(policy, "grad_dtype", None)


def _param_row(state, name: str, param) -> dict:
    """One param: its route, owners, dtypes and the policy overrides that applied."""
    policy = state.policies.get(name)
    dedicated = is_dedicated(param)
    owners = sorted({state.plan.params[u].owner for u in
                     state.plan.param_fqns[param._dmuon_dedicated]}) if dedicated else []
    param_dtype, grad_dtype = _run_dtypes(state, param, policy)
    return {"name": name, "route": _route_of(state, name, param), "dmuon_managed":
            policy is not None or dedicated, "owners": owners,
            "param_dtype": _dtype(param_dtype), "grad_dtype": _dtype(grad_dtype),
            "master_dtype": _dtype(param.dtype),
            "output_dtype": _dtype(getattr(policy, "output_dtype", None)),
            "matched_overrides": list(getattr(policy, "matched", ()))}


def summarize_param_groups(model: nn.Module, optimizer, *, max_rows: int = 128) -> dict:
    """How ``dmuon.Muon`` routed the trainable params: the count and elements per route
    over all ranks, each optimizer group (this rank's params in it), and one row per
    param (``max_rows`` at most) with its route, owners, dtypes and matched overrides."""
    state = get_state(model)
    params = {n: p for n, p in params_by_name(model).items() if p.requires_grad}
    routes = {r: {"params": 0, "numel": 0} for r in _ROUTES}
    for name, p in params.items():
        route = routes[_route_of(state, name, p)]
        route["params"] += 1
        route["numel"] += _whole_numel(state, name, p)
    groups = [{"index": i, "group_name": g.get("group_name"), "kind": g["kind"],
               "dmuon_route": g.get("dmuon_route"), "lr": g["lr"],
               "weight_decay": g["weight_decay"], "local_params": len(g["params"]),
               "local_numel": sum(_local(p).numel() for p in g["params"])}
              for i, g in enumerate(optimizer.param_groups)]
    rows = [_param_row(state, n, p) for n, p in params.items()]
    return {"all_routes": routes, "groups": groups, "params": rows[:max_rows],
            "rows_truncated": len(rows) > max_rows}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _whole_numel(state, name: str, p) -> int:
    if is_dedicated(p):
        return sum(state.plan.params[u].numel
                   for u in state.plan.param_fqns[p._dmuon_dedicated])
    return p.numel()  # a DTensor's numel is the whole param's


def summarize_comm_plan(model: nn.Module, *, max_groups: int = 64,
                        max_params_per_group: int = 128) -> dict:
    """DMuon's communication plan: per hook boundary (in forward order) its units with
    owner, elements and route, the owners it gathers from, and its bytes per gather in
    ``param_dtype``; with the shard-dim bytes per step this plan moves (Z3: 3 (N-1)/N of
    the dedicated bytes, Z2: 2 (N-1)/N), an estimate the ledger then measures."""
    state = get_state(model)
    plan, ctx = state.plan, state.ctx
    groups, total = [], 0
    for b in state.boundaries:
        units = [plan.params[m.fqn] for m in b.members]
        elt = torch.empty((), dtype=b.param_dtype).element_size()
        size = sum(a.numel for a in units) * elt
        total += size
        groups.append({"name": b.name, "owners": sorted({a.owner for a in units}),
                       "bytes_per_gather": size, "param_dtype": _dtype(b.param_dtype),
                       "params": [{"name": a.fqn, "owner": a.owner, "numel": a.numel,
                                   "route": a.route, "tp": a.tp}
                                  for a in units[:max_params_per_group]]})
    N, passes = ctx.shard_size, 3 if state.reshard_after_forward else 2
    return {"layout": {"shard": plan.shard_size, "replicate": plan.replicate_size,
                       "tp": plan.tp_size, "ep": plan.ep_size},
            "mode": "z3" if state.reshard_after_forward else "z2",
            "prefetch": state.prefetch_depth, "groups": groups[:max_groups],
            "groups_truncated": len(groups) > max_groups,
            "shard_bytes_per_step": passes * (N - 1) * total / N}


@dataclasses.dataclass(frozen=True)
class DedicatedCommContext:
    """A read-only view of how DMuon talks for one model: its device, its own groups
    (gathers, reduces, replicate, TP, EP), the streams and the ledger, and the
    communicators this rank belongs to as ``(name, ranks)``."""

    device: torch.device
    shard_group: object
    reduce_group: object
    replicate_group: object
    tp_group: object
    ep_group: object
    streams: object
    ledger: object
    communicators: tuple

    def consume_forward_unshard_profile(self, *, clear: bool = True) -> dict:
        return _forward_profile(self.ledger)


def get_comm_ctx(model: nn.Module) -> DedicatedCommContext | None:
    """The model's ``DedicatedCommContext``; None when it was not dedicated."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        return None
    c = state.ctx
    ep = state.expert_ctx.ep_group if state.expert_ctx is not None else None
    return DedicatedCommContext(c.device, c.shard_group, c.reduce_group, c.replicate_group,
                                c.tp_group, ep, c.streams, c.ledger,
                                tuple((n, r) for n, r, _ in state.communicators.mine))


def _forward_profile(ledger) -> dict:
    by_phase = ledger.last_step_by_phase()
    return {"steps": ledger.steps_closed,
            "forward_bytes": {d: p.get("forward", 0) for d, p in by_phase.items()},
            "recompute_bytes": {d: p.get("recompute", 0) for d, p in by_phase.items()},
            "timings": None}


def collect_forward_unshard_profile(model: nn.Module, *, clear: bool = True,
                                    synchronize: bool = False) -> dict:
    """The last step's forward gathers: bytes by mesh dim (and recompute's), from the
    ledger, always recorded. The reference's CUDA-event timings are not kept here
    (``timings`` is None; ``bench/overlap.py`` times the waits); ``clear`` is accepted,
    ``synchronize`` waits for the device first."""
    if synchronize and torch.cuda.is_available():
        torch.cuda.synchronize()
    return _forward_profile(get_state(model).ledger)
