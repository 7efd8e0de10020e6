"""Full tensors from a dedicated model, and the guard that keeps ``state_dict`` from
returning placeholders."""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
from torch import nn

from . import comm
from .expert_parallel import gather_experts
from .fqn import canonical_fqn
from .model_state import get_state

_guard = threading.local()
_REDISTRIBUTE_LOG = "torch.distributed.tensor._redistribute"  # DTensor's logger


def units_by_key(plan) -> dict[str, list[str]]:
    """State-dict key -> the plan's units of that param."""
    return {canonical_fqn(fqn): units for fqn, units in plan.param_fqns.items()}


@contextlib.contextmanager
def allow_raw_state_dict():
    prev = getattr(_guard, "allowed", False)
    _guard.allowed = True
    try:
        yield
    finally:
        _guard.allowed = prev


def raw_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` past the guard, keyed by canonical FQN (a compiled block's
    ``_orig_mod.`` left out, as torch.distributed.checkpoint's helpers do), so that its
    dedicated entries, DMuon's placeholders, are found by name and never read."""
    with allow_raw_state_dict():
        return {canonical_fqn(k): v for k, v in model.state_dict().items()}


def install_state_dict_guard(model: nn.Module, plan) -> None:
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


def _gathered_owned(state, b, owned_tensor) -> torch.Tensor:
    """The boundary's owned tensors (``owned_tensor(b, unit)``: the masters, or their
    momentum) in full, in the master dtype, on every rank: the owners' parts over the
    replicate group into the column, the columns over the shard group."""
    ctx, dtype = b.ctx, b.master_dtype
    mine = [owned_tensor(b, m.fqn).detach().reshape(-1) for m in b.owned]
    mine = torch.cat(mine) if mine else torch.empty(0, dtype=dtype, device=ctx.device)
    column = torch.empty(b.column_sizes[ctx.shard_rank], dtype=dtype, device=ctx.device)
    if ctx.replicate_group is None:
        column.copy_(mine)
    else:
        work = comm.all_gather_v(column, b.replica_sizes, mine, ctx.replicate_group,
                                 ctx.ledger, "replicate", "state_dict")
        comm.wait(work)
    flat = torch.empty(b.numel, dtype=dtype, device=ctx.device)
    work = comm.all_gather_v(flat, b.column_sizes, column, ctx.shard_group, ctx.ledger,
                             "shard", "state_dict")
    comm.wait(work)
    return flat


def full_owned(state, owned_tensor) -> dict[str, torch.Tensor]:
    """State-dict key -> the dedicated param's tensor in full (collective): TP shards
    joined, slices of experts concatenated, an expert-parallel layer's experts gathered
    from its EP ranks."""
    by_unit, ep_group = {}, {}
    for b in state.boundaries:
        flat = _gathered_owned(state, b, owned_tensor)
        for m in b.members:
            local = flat[m.offset:m.offset + m.numel].view(m.shape)
            by_unit[m.fqn] = m.tp.as_dtensor(local).full_tensor() if m.tp else local
            if m.ep_base is not None:
                ep_group[m.fqn] = b.ctx.ep_group
    out = {}
    for key, units in units_by_key(state.plan).items():
        here = [u for u in units if u in by_unit]
        whole = torch.cat([by_unit[u] for u in here])
        out[key] = gather_experts(whole, ep_group[here[0]]) if here[0] in ep_group else whole
    return out


class _ExactGathers(logging.Filter):
    """Drops DTensor's note that a redistribute runs "N sequential all_gather operations
    ... and may give inconsistent results between ranks due to different reduction
    orders": an all-gather reduces nothing, it only moves bytes, so every rank gets the
    same exact tensor. Any other record (a reduce-scatter's or all-reduce's) passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather operations" not in record.getMessage()


def gather_whole(value) -> torch.Tensor:
    """A DTensor's full value (``full_tensor()``), without DTensor's warning about it.

    An FSDP2 shard of a TP shard, (_StridedShard(0), Shard(0)), is gathered TP dim first,
    then FSDP's: DTensor cannot merge those two all-gathers into one (the dims are not in
    ascending order) and logs a warning on every rank that sounds like a wrong result.
    Gathering one dim at a time by hand is no way out: DTensor's _StridedShard does not
    unpad after a gather of its inner dim alone. So that one message is dropped, for
    this call only (docs/jobs.md)."""
    log = logging.getLogger(_REDISTRIBUTE_LOG)
    quiet = _ExactGathers()
    log.addFilter(quiet)
    try:
        return value.full_tensor()
    finally:
        log.removeFilter(quiet)


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer in full, by FQN, on every rank.

    Collective: every rank of the mesh must call it. Dedicated params come from their
    owners' masters (fp32 under mixed precision); FSDP2 shards are all-gathered.
    """
    state = get_state(model)
    state.drain()
    raw = raw_state_dict(model)
    owned_values = full_owned(state, lambda b, unit: b.masters[unit])
    full: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        if key in owned_values:
            full[key] = owned_values[key].clone()
        elif hasattr(value, "full_tensor"):
            tensor = gather_whole(value)
            # on a shard dim of size 1 full_tensor() returns the live local shard itself
            aliased = tensor.data_ptr() == value.to_local().data_ptr()
            full[key] = tensor.clone() if aliased else tensor
        else:
            full[key] = value.detach().clone()
    return full
