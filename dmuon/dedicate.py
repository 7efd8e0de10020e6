"""``dedicate_params``: give every Muon-target matrix one owner, lay each hook boundary's
matrices out in one packed buffer, and install the hooks.

DMuon issues its collectives on process groups of its own (same members as the mesh's):
its gradient reduces follow an order of their own (see ``reduce.py``), which must never
interleave with FSDP2's collectives on a shared communicator, and on NCCL separate
communicators let DMuon's traffic overlap FSDP2's.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
from torch import nn

from . import comm, tp_traffic
from .buffers import Boundary, Member
from .expert_parallel import ep_subgroups
from .full_state import install_state_dict_guard
from .model_state import DEDICATED_ATTR, STATE_ATTR, DedicatedModel, RankContext
from .partition import (
    EP_ATTR,
    DedicationPlan,
    PlanMismatch,
    check_plan,
    model_entries,
    model_ep,
    plan_from_shapes,
)
from .precision import POLICY_ATTR, boundary_precision, install_casts, uses_precision
from .process_groups import Communicators, mesh_device
from .routing import ROUTE_ATTR, owner_adamw, resolve_policies, routed_predicate
from .tp import tp_shard_of

_log = logging.getLogger(__name__)


def _groups_like(group, copies: int, comms: Communicators, name: str) -> list:
    """``copies`` new groups with ``group``'s members. ``new_group`` is collective over
    the world, so every rank creates every row's groups, in one order."""
    mine = tuple(dist.get_process_group_ranks(group))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    out = []
    for copy in range(copies):
        for row in sorted(set(rows)):
            new = comms.new_group(row, f"{name}:{copy}")
            if row == mine:
                out.append(new)
    return out


def _rank_context(mesh, replicate_mesh, reduce_dtype, comms: Communicators) -> RankContext:
    if mesh.ndim != 1:
        raise ValueError(
            f"dedicate_params got a {mesh.ndim}-D mesh {mesh.mesh_dim_names} without "
            "replicate_mesh; for HSDP pass mesh=hsdp['shard'], replicate_mesh=hsdp['replicate']"
        )
    if replicate_mesh is not None and replicate_mesh.ndim != 1:
        raise ValueError("replicate_mesh must be a 1-D mesh (the 'replicate' dim of the HSDP mesh)")
    device = mesh_device(mesh)
    shard_group, reduce_group = _groups_like(mesh.get_group(), 2, comms, "shard")
    r = replicate_mesh
    replicate_group, presence_group = _groups_like(r.get_group(), 2, comms, "replicate") \
        if r is not None else (None, None)
    return RankContext(
        device, shard_group, reduce_group, mesh.get_local_rank(), mesh.size(),
        replicate_group, presence_group, r.get_local_rank() if r is not None else 0,
        r.size() if r is not None else 1, comm.Ledger(), comm.Streams(device), reduce_dtype,
    )


def _policy(mp_policy, compute_dtype, model: nn.Module, fqns):
    """DMuon's own policy, when ``dedicate_params`` is given one. ``compute_dtype=X`` (the
    reference's name) computes and gathers in X and reduces in the dedicated params' own
    dtype: the masters' precision, which a sum of many ranks' half-precision gradients
    needs (FSDP2's ``reduce_dtype=None`` would reduce in X)."""
    if compute_dtype is None:
        return mp_policy
    if mp_policy is not None:
        raise ValueError("dedicate_params takes mp_policy or compute_dtype, not both "
                         "(compute_dtype=X is mp_policy=MixedPrecisionPolicy(param_dtype=X, "
                         "reduce_dtype=<the dedicated params' dtype>))")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtypes = {model.get_parameter(f).dtype for f in fqns}
    if len(dtypes) != 1:
        raise ValueError(f"compute_dtype with dedicated params of dtypes "
                         f"{sorted(map(str, dtypes))}: pass mp_policy=MixedPrecisionPolicy("
                         "param_dtype=..., reduce_dtype=...) to say which dtype reduces")
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=dtypes.pop())


PROCESS_GROUP_POLICIES = (None, "isolated")


def _check_can_dedicate(model: nn.Module, prefetch: int, process_group_policy=None) -> None:
    from torch.distributed.fsdp import FSDPModule

    if process_group_policy not in PROCESS_GROUP_POLICIES:
        raise ValueError(
            f"process_group_policy={process_group_policy!r}: DMuon always talks on process "
            "groups of its own, with the mesh's members ('isolated', the default), so a "
            "training loop's collectives never interleave with its asynchronous ones; "
            "sharing the mesh's groups ('shared') is refused")
    if hasattr(model, STATE_ATTR):
        raise RuntimeError("dedicate_params was already called on this model")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise RuntimeError(
                f"fully_shard was applied to '{name or '<root>'}' before "
                "dmuon.dedicate_params; call dedicate_params first so FSDP2 leaves the "
                "Muon-target params to DMuon (order: TP, dedicate_params, fully_shard)"
            )


def _expert_context(ctx: RankContext, mesh, ep_size: int, comms: Communicators) -> RankContext:
    """The context of expert-parallel boundaries: the expert shard group (two copies, for
    gathers and reduces) in place of the shard group, and the EP group."""
    group = mesh.get_group()
    gather, reduce = (ep_subgroups(group, ep_size, True, comms) for _ in range(2))
    return dataclasses.replace(
        ctx, shard_group=gather, reduce_group=reduce, shard_rank=ctx.shard_rank // ep_size,
        shard_size=ctx.shard_size // ep_size,
        ep_group=ep_subgroups(group, ep_size, False, comms))


def _local_shapes(plan: DedicationPlan, params: dict) -> dict[str, torch.Size]:
    """Each unit's shape as this rank computes with it (a TP shard's local shape)."""
    out = {}
    for unit, a in plan.params.items():
        p = params[a.param]
        shape = p._local_tensor.shape if hasattr(p, "_local_tensor") else p.shape
        out[unit] = torch.Size((a.experts[1] - a.experts[0], *shape[1:])) if a.experts \
            else shape
    return out


def _member(a, index: int, param: nn.Parameter, shape, ep_size: int) -> Member:
    """The unit as this rank holds it: an expert-parallel slice's owner by its column in
    the expert shard group, its experts counted from this rank's first."""
    if a.ep is None:
        return Member(a.fqn, param, a.owner_coord, index, shape, experts=a.experts)
    base = a.ep * getattr(param, EP_ATTR)[0] // ep_size
    r, s = a.owner_coord
    return Member(a.fqn, param, (r, s // ep_size), index, shape,
                  experts=(a.experts[0] - base, a.experts[1] - base), ep_base=base)


def _members(plan: DedicationPlan, params: dict, shapes: dict,
             ep: int | None) -> dict[str, list[Member]]:
    """Boundary -> this rank's members (expert-parallel units of its EP coordinate only)."""
    out: dict[str, list[Member]] = {}
    kinds: dict[str, set] = {}
    for index, (unit, a) in enumerate(plan.params.items()):
        kinds.setdefault(a.boundary, set()).add(a.ep is None)
        if a.ep is not None and a.ep != ep:
            continue
        out.setdefault(a.boundary, []).append(
            _member(a, index, params[a.param], shapes[unit], plan.ep_size))
    mixed = sorted(b for b, k in kinds.items() if len(k) > 1)
    if mixed:
        raise ValueError(f"hook boundary '{mixed[0]}' holds expert-parallel and other "
                         "params: give the experts' module a boundary of its own "
                         "(hook_boundary_predicate)")
    return out


def _param_dtype(members: list[Member], mp_policy) -> tuple[torch.dtype, torch.dtype]:
    dtypes = {m.param.dtype for m in members}
    if len(dtypes) != 1:
        raise ValueError(f"hook boundary params have mixed dtypes {sorted(map(str, dtypes))}")
    master = dtypes.pop()
    param_dtype = getattr(mp_policy, "param_dtype", None) or master
    return param_dtype, master


def _storage_less_like(p: nn.Parameter, device) -> nn.Parameter:
    """A parameter like ``p`` without storage: a TP shard stays the DTensor it is, its
    local part empty until ``bind_views``."""
    local = torch.empty(0, dtype=p.dtype, device=device)
    tp = tp_shard_of(p)
    if tp is not None:
        local = tp.as_dtensor(local)
    return nn.Parameter(local, requires_grad=p.requires_grad)


def leave_meta(state: DedicatedModel) -> None:
    """Dedicated params still on the meta device get a storage-less tensor on the mesh's
    device as their content, keeping their identity (``swap_tensors``: the boundaries,
    the marks and the user's references stay valid; only autograd's hooks, which live on
    the content, are registered again)."""
    for b in state.boundaries:
        swapped = False
        for p in b.params:
            if not p.is_meta:
                continue
            new = _storage_less_like(p, state.ctx.device)
            marks = {k: v for k, v in p.__dict__.items() if k not in new.__dict__}
            torch.utils.swap_tensors(p, new)
            p.__dict__.update(marks)
            swapped = True
        if swapped:
            next(h for h in state.hooks if h.boundary is b).hook_gradients()


def build_boundaries(plan: DedicationPlan, contexts: tuple, model: nn.Module, shapes: dict,
                     policy, precision: dict | None = None) -> list[Boundary]:
    """Packed buffers for every boundary, filled with the params' current values
    (unless on the meta device), the module's tensors then viewing them.

    A model that had its values keeps the placeholders' storage until the first forward
    (no more memory than the model held before), a meta model its meta params until
    ``dmuon.materialize``: a ``fully_shard`` bound before ``import dmuon`` then shards a
    copy, or meta tensors, leaving DMuon's storage untouched, and ``check_dedicated``
    names the param instead of a storage-size error.

    Boundaries go in forward order, the modules' (a parent's forward begins before its
    children's): by their params' order a boundary nested in another (an experts module
    inside its block) whose params come first would go first, and prefetch would
    gather the wrong neighbour. ``contexts``: (the rank's, the expert-parallel one's);
    ``precision``: a boundary's own (param_dtype, grad_dtype, ...) (``dmuon.precision``)."""
    ctx, expert_ctx = contexts
    boundaries = []
    ep = ctx.shard_rank % plan.ep_size
    members = _members(plan, dict(model.named_parameters()), shapes, ep)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    for name in sorted(members, key=order.__getitem__):
        members_here = members[name]
        here = expert_ctx if members_here[0].ep_base is not None else ctx
        param_dtype, master = _param_dtype(members_here, policy)
        own_param, own_grad, *_ = (precision or {}).get(name, (None, None))
        if own_grad is not None:  # its reduce in the policy's grad_dtype
            here = dataclasses.replace(here, reduce_dtype=own_grad)
        b = Boundary(name, members_here, here, own_param or param_dtype, master)
        if b.on_meta:
            b.free()  # the module keeps its meta params until dmuon.materialize
        else:
            b.load_initial_values()
            b.bind_views()
        boundaries.append(b)
    return boundaries


def _plan_to_run(stored, entries: list, sizes: tuple[int, int], ep: tuple, adamw):
    """The stored plan, checked against the model, mesh and routes (a copy:
    ``dedicate_params`` fills in TP modes and binds params), else a new partition.
    ``sizes``: (shard, replicate); ``ep``: (the expert-parallel params, the EP degree);
    ``adamw``: the params routed to AdamW on their owner."""
    if stored is None:
        return plan_from_shapes(entries, *sizes, ep_params=ep[0], ep_size=ep[1],
                                owner_adamw=adamw)
    plan = DedicationPlan.from_dict(
        stored.to_dict() if isinstance(stored, DedicationPlan) else stored)
    check_plan(plan, entries, *sizes, *ep)
    for a in plan.params.values():
        if (a.route == "adamw") != (a.param in adamw):
            raise PlanMismatch(f"'{a.param}': the plan routes it to {a.route!r}, the "
                               "param_policy does not")
    return plan


def _plan_and_policies(model: nn.Module, mesh, predicate, replicate_mesh, stored,
                       hooks: tuple, dtypes: tuple, routing: tuple,
                       allow_empty: bool = False) -> tuple:
    """(the plan, DMuon's mixed-precision policy, each selected param's routing policy,
    each boundary's own precision).
    ``hooks``: the boundary predicate and strictness; ``dtypes``: ``mp_policy`` and
    ``compute_dtype``; ``routing``: ``param_policy``, ``param_policy_fn``,
    ``route_hint_fn``."""
    policies = resolve_policies(model, predicate, *routing)
    predicate, adamw = routed_predicate(predicate, policies), owner_adamw(policies)
    entries = model_entries(model, predicate, *hooks, adamw, allow_empty)
    mp_policy = _policy(*dtypes, model, [e[0] for e in entries])
    if uses_precision(policies) and mp_policy is not None:
        raise ValueError("dedicate_params takes dtypes from param_policy or from mp_policy/"
                         "compute_dtype, not both")
    precision = boundary_precision(entries, policies)
    sizes = (mesh.size(), replicate_mesh.size() if replicate_mesh is not None else 1)
    plan = _plan_to_run(stored, entries, sizes, model_ep(model, predicate), adamw)
    return plan, mp_policy, policies, precision


def _contexts(mesh, replicate_mesh, mp_policy, plan: DedicationPlan) -> tuple:
    """(this rank's context, the expert-parallel one or None, DMuon's groups, warmed)."""
    comms = Communicators()
    ctx = _rank_context(mesh, replicate_mesh, getattr(mp_policy, "reduce_dtype", None), comms)
    expert_ctx = _expert_context(ctx, mesh, plan.ep_size, comms) if plan.ep_size > 1 else None
    comms.warm(ctx.device)
    return ctx, expert_ctx, comms


def dedicate_params(model: nn.Module, mesh, predicate, *, replicate_mesh=None,
                    reshard_after_forward: bool = True, hook_boundary_predicate=None,
                    hook_boundary_strict: bool = True, mp_policy=None,
                    compute_dtype: torch.dtype | None = None, prefetch: int = 1,
                    plan: DedicationPlan | dict | None = None, param_policy=None,
                    param_policy_fn=None, route_hint_fn=None,
                    process_group_policy: str | None = None,
                    allow_empty: bool = False) -> DedicationPlan:
    """Assign each dedicated param an owner and install DMuon's hooks; returns the plan,
    which also maps each dedicated ``nn.Parameter`` to its owner's global rank.

    ``mp_policy`` (FSDP2's ``MixedPrecisionPolicy``): packed buffers and gathers in
    ``param_dtype``, reduces in ``reduce_dtype``, masters and momentum in the params' own
    dtype; given here it is DMuon's own, else the first ``dmuon.fully_shard(mp_policy=)``
    over a boundary sets it for both. ``compute_dtype=X`` (the reference's name) is
    ``mp_policy=MixedPrecisionPolicy(param_dtype=X, reduce_dtype=<the params' dtype>)``.
    A non-matrix param the predicate selects goes to AdamW, with one warning naming them
    all. ``prefetch``: how many boundaries ahead the all-gathers go. A meta model is
    planned without values (``dmuon.materialize`` creates them). ``plan``: a stored plan
    (or its ``to_dict()``) to apply, refused with ``PlanMismatch`` before any collective
    when it does not describe this model and mesh. Pure DMuon (``dmuon.routing``):
    ``param_policy``, ``param_policy_fn(name, param)`` or the legacy
    ``route_hint_fn(name, param)`` route each selected param to ``"muon"``, ``"adamw"``
    (dedicated, AdamW on its owner) or ``"sharded_adamw"`` (left to FSDP2).
    ``process_group_policy``: ``"isolated"`` (the default; DMuon's own groups), only.
    ``allow_empty``: selecting nothing is no error (a pipeline stage of only AdamW params).
    """
    _check_can_dedicate(model, prefetch, process_group_policy)
    plan, mp_policy, policies, precision = _plan_and_policies(
        model, mesh, predicate, replicate_mesh, plan,
        (hook_boundary_predicate, hook_boundary_strict), (mp_policy, compute_dtype),
        (param_policy, param_policy_fn, route_hint_fn), allow_empty)
    ctx, expert_ctx, comms = _contexts(mesh, replicate_mesh, mp_policy, plan)
    params = dict(model.named_parameters())
    boundaries = build_boundaries(plan, (ctx, expert_ctx), model,
                                  _local_shapes(plan, params), mp_policy, precision)
    _record_tp(plan, boundaries, ctx)
    for name, (param_dtype, _, output_dtype, cast) in precision.items():
        install_casts(model.get_submodule(name), param_dtype, output_dtype, cast)
    state = DedicatedModel(model, plan, ctx, boundaries, expert_ctx=expert_ctx,
                           communicators=comms, reshard_after_forward=reshard_after_forward,
                           prefetch=prefetch, mp_policy=mp_policy, policies=policies,
                           own_mp_policy=mp_policy is not None or uses_precision(policies))
    _attach(model, state)
    return plan


def _log_assignment(plan: DedicationPlan) -> None:
    """The reference's INFO summary, word for word (its guide tells users to read it)."""
    _log.info("dedicate_params: %d params assigned to %d ranks, imbalance=%.1f%%, loads=%s",
              len(plan.param_fqns), len(plan.elements_per_rank), (plan.imbalance - 1) * 100,
              plan.elements_per_rank)


def _record_tp(plan: DedicationPlan, boundaries: list[Boundary], ctx: RankContext) -> None:
    """The TP modes of dedicated TP shards into the plan, their group into the context
    (their NS talks there)."""
    for b in boundaries:
        for m in b.members:
            if m.tp is not None:
                plan.params[m.fqn] = dataclasses.replace(plan.params[m.fqn], tp=m.tp.mode)
                plan.tp_size = m.tp.size
                ctx.tp_group = m.tp.group


def _attach(model: nn.Module, state: DedicatedModel) -> None:
    """The marks on dedicated params, the state-dict guard, ``zero_grad``, the state;
    the assignment's summary logged."""
    plan, params = state.plan, dict(model.named_parameters())
    for fqn in plan.param_fqns:
        setattr(params[fqn], DEDICATED_ATTR, fqn)  # truthy, and names it in errors
        setattr(params[fqn], ROUTE_ATTR, plan.params[plan.param_fqns[fqn][0]].route)
        params[fqn]._dmuon_owner_state = state  # param groups find the state
    for name, policy in state.policies.items():  # sharded_adamw: dmuon.fully_shard reads it
        if name not in plan.param_fqns:
            setattr(params[name], POLICY_ATTR, policy)
    install_state_dict_guard(model, plan)
    tp_traffic.attach(model, state)
    _discarding_zero_grad(model, state)
    plan.bind(params)
    setattr(model, STATE_ATTR, state)
    _log_assignment(plan)


def _discarding_zero_grad(model: nn.Module, state: DedicatedModel) -> None:
    """``model.zero_grad()`` drops DMuon's gradients too: a dedicated param's gradient
    has left its ``.grad`` for DMuon's buffers by then, where ``nn.Module.zero_grad``
    cannot see it. Set on the instance, so FSDP2's class swap keeps it."""

    def zero_grad(set_to_none: bool = True) -> None:
        state.discard_gradients(set_to_none)
        type(model).zero_grad(model, set_to_none)

    model.zero_grad = zero_grad
