"""``dedicate_params``: give every Muon-target matrix one owner, pack the rest of the
ranks' copies into per-(boundary, owner) buffers and install the hooks."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
from torch import nn

from . import comm
from .buffers import PackedGroup, RankContext
from .hooks import BoundaryHooks
from .partition import DedicationPlan, partition

_STATE_ATTR = "_dmuon_state"
_DEDICATED_ATTR = "_dmuon_dedicated"
_guard = threading.local()


class DMuonState:
    """Everything ``dedicate_params`` attaches to a model (one per model)."""

    def __init__(self, plan: DedicationPlan, ctx: RankContext, reshard_after_forward: bool):
        self.plan, self.ctx = plan, ctx
        self.reshard_after_forward = reshard_after_forward
        self.groups: list[PackedGroup] = []
        self.boundaries: dict[str, BoundaryHooks] = {}
        self.memory_trace: list[tuple[str, int]] | None = None

    @property
    def ledger(self) -> comm.Ledger:
        return self.ctx.ledger

    @property
    def owned_params(self) -> dict[str, nn.Parameter]:
        """FQN -> this rank's authoritative copy, for params this rank owns."""
        return {
            m.fqn: own
            for g in self.groups if g.is_owner
            for m, own in zip(g.members, g.owned)
        }

    def live_packed_bytes(self) -> int:
        storages = {id(g.storage): g.storage.untyped_storage().nbytes() for g in self.groups}
        return sum(storages.values())

    def trace(self, event: str) -> None:
        if self.memory_trace is not None:
            self.memory_trace.append((event, self.live_packed_bytes()))

    def finish_gradient_sync(self) -> None:
        """Reduce whatever the grad hooks have not (unused params), then wait for all."""
        for g in self.groups:
            if not g.reduce_pending and g.has_local_grads():
                g.start_reduce()
        for g in self.groups:
            for m in g.members:
                if m.experts is not None:  # every slice has taken its part by now
                    m.param.grad = None
            g.finish_reduce()

    def after_step(self, replicate_async: bool) -> None:
        for g in self.groups:
            g.fresh = False
            g.start_replicate_broadcast()
        if not replicate_async:
            self.drain()

    def drain(self) -> None:
        """Wait for pending post-step broadcasts (before anything reads owned values)."""
        for g in self.groups:
            g.wait_replicate_broadcast()


def get_state(model: nn.Module) -> DMuonState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise RuntimeError("model has no DMuon state: call dmuon.dedicate_params(model, ...) first")
    return state


def get_plan(model: nn.Module) -> DedicationPlan:
    """The plan ``dedicate_params`` made for ``model``."""
    return get_state(model).plan


def is_dedicated(param: nn.Parameter) -> bool:
    return bool(getattr(param, _DEDICATED_ATTR, False))


def _check_not_fully_sharded(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise RuntimeError(
                f"fully_shard was applied to '{name or '<root>'}' before "
                "dmuon.dedicate_params; call dedicate_params first so FSDP2 leaves the "
                "Muon-target params to DMuon (order: TP, dedicate_params, fully_shard)"
            )


def _boundary_groups(plan, boundary, units, params, ctx) -> list[PackedGroup]:
    """One packed group per owner of the boundary's matrices, plus one per slice of
    experts of each 3-D param (the slices share that param's storage)."""
    by_owner: dict[int, list] = {}
    groups, expert_bases = [], {}
    for unit in units:
        a = plan.params[unit]
        if a.experts is None:
            by_owner.setdefault(a.owner, []).append((unit, params[unit]))
            continue
        param = params[a.param]
        if a.param not in expert_bases:
            expert_bases[a.param] = torch.empty_like(param.detach())
        groups.append(PackedGroup(boundary, a.owner_coord, [(unit, param)], ctx,
                                  experts=a.experts, expert_base=expert_bases[a.param]))
    for fqn, base in expert_bases.items():
        params[fqn].data = base  # after the slices' owners took their initial values
    groups += [PackedGroup(boundary, plan.params[members[0][0]].owner_coord, members, ctx)
               for _, members in sorted(by_owner.items())]
    return groups


def _rank_context(mesh, replicate_mesh) -> RankContext:
    if mesh.ndim != 1:
        raise ValueError(
            f"dedicate_params got a {mesh.ndim}-D mesh {mesh.mesh_dim_names} without "
            "replicate_mesh; for HSDP pass mesh=hsdp['shard'], replicate_mesh=hsdp['replicate']"
        )
    if replicate_mesh is not None and replicate_mesh.ndim != 1:
        raise ValueError("replicate_mesh must be a 1-D mesh (the 'replicate' dim of the HSDP mesh)")
    ledger = comm.Ledger()
    shard_group = mesh.get_group()
    if replicate_mesh is None:
        return RankContext(shard_group, mesh.get_local_rank(), mesh.size(), None, 0, 1, ledger)
    return RankContext(
        shard_group, mesh.get_local_rank(), mesh.size(),
        replicate_mesh.get_group(), replicate_mesh.get_local_rank(), replicate_mesh.size(),
        ledger,
    )


def dedicate_params(
    model: nn.Module,
    mesh,
    *,
    predicate,
    replicate_mesh=None,
    reshard_after_forward: bool = True,
    hook_boundary_predicate=None,
    hook_boundary_strict: bool = True,
) -> DedicationPlan:
    """Assign each Muon-target matrix an owner and install DMuon's hooks; returns the plan."""
    if hasattr(model, _STATE_ATTR):
        raise RuntimeError("dedicate_params was already called on this model")
    _check_not_fully_sharded(model)
    ctx = _rank_context(mesh, replicate_mesh)
    plan = partition(
        model, predicate=predicate, shard_size=ctx.shard_size,
        replicate_size=ctx.replicate_size, hook_boundary_predicate=hook_boundary_predicate,
        hook_boundary_strict=hook_boundary_strict,
    )
    params = dict(model.named_parameters())
    for fqn in plan.param_fqns:
        if params[fqn].is_meta:
            raise ValueError(
                f"'{fqn}' is on the meta device: dedicate_params needs materialised "
                "parameters (use dmuon.partition to plan a meta model)"
            )
    state = DMuonState(plan, ctx, reshard_after_forward)
    for boundary, units in plan.boundaries.items():
        groups = _boundary_groups(plan, boundary, units, params, ctx)
        state.groups.extend(groups)
        state.boundaries[boundary] = BoundaryHooks(
            boundary, model.get_submodule(boundary), groups, state
        )
    for g in state.groups:
        for m in g.members:
            if m.tp is not None:
                plan.params[m.fqn] = dataclasses.replace(plan.params[m.fqn], tp=m.tp.mode)
    for fqn in plan.param_fqns:
        setattr(params[fqn], _DEDICATED_ATTR, fqn)  # truthy, and names it in errors
    _install_state_dict_guard(model, plan)
    setattr(model, _STATE_ATTR, state)
    return plan


# -- state dicts ---------------------------------------------------------------------

@contextlib.contextmanager
def _allow_raw_state_dict():
    prev = getattr(_guard, "allowed", False)
    _guard.allowed = True
    try:
        yield
    finally:
        _guard.allowed = prev


def _install_state_dict_guard(model: nn.Module, plan: DedicationPlan) -> None:
    parents = {fqn.rsplit(".", 1)[0] if "." in fqn else "" for fqn in plan.param_fqns}

    def refuse(action):
        def hook(module, *args, **kwargs):
            if getattr(_guard, "allowed", False):
                return
            raise RuntimeError(
                f"{action} would {'return' if action == 'state_dict' else 'write'} DMuon "
                "placeholders: Muon-target params live in full only on their owner rank. "
                "Use dmuon.full_state_dict(model) for full tensors on every rank, or "
                "dmuon.checkpoint for sharded save/load"
            )
        return hook

    for name in parents:
        module = model.get_submodule(name)
        module.register_state_dict_pre_hook(refuse("state_dict"))
        module.register_load_state_dict_pre_hook(refuse("load_state_dict"))


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer in full, by FQN, on every rank.

    Collective: every rank of the mesh must call it. Dedicated params come from
    their owners' authoritative copies; FSDP2 shards are all-gathered.
    """
    state = get_state(model)
    state.drain()
    with _allow_raw_state_dict():
        raw = model.state_dict()
    full: dict[str, torch.Tensor] = {}
    owned_values = {}
    for g in state.groups:
        flat = torch.empty(g.numel, dtype=g.dtype, device=g.device)
        if g.is_column_owner:
            torch.cat([o.view(-1) for o in g.owned], out=flat)
        comm.broadcast(flat, g.owner_shard, state.ctx.shard_group, state.ledger,
                       "shard", "state_dict").wait()
        for m in g.members:
            local = flat[m.offset:m.offset + m.numel].view(m.shape)
            owned_values[m.fqn] = m.tp.as_dtensor(local).full_tensor() if m.tp else local
    for fqn, units in state.plan.param_fqns.items():
        if units != [fqn]:  # a 3-D param from its slices of experts
            owned_values[fqn] = torch.cat([owned_values.pop(u) for u in units])
    for key, value in raw.items():
        if key in owned_values:
            full[key] = owned_values[key].clone()
        elif hasattr(value, "full_tensor"):
            tensor = value.full_tensor()
            # on a shard dim of size 1 full_tensor() returns the live local shard itself
            aliased = tensor.data_ptr() == value.to_local().data_ptr()
            full[key] = tensor.clone() if aliased else tensor
        else:
            full[key] = value.detach().clone()
    return full
