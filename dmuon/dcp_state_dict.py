"""``torch.distributed.checkpoint.state_dict``'s four functions for a dedicated model, under
the names the seeds' reference implementation exports.

A *full* state dict holds every tensor in full, keyed as a single-process
``model.state_dict()`` keys it, so a Hugging Face or torch checkpoint loads as it is: each
owner keeps its matrices, each FSDP2 shard takes its slice, and nothing else is allocated
beyond one tensor's slice at a time. A *sharded* one is this rank's share as
``dmuon.checkpoint`` writes it (owners' matrices by FQN, FSDP2 params as DTensors); it
loads back onto the same layout (``dmuon.checkpoint`` reshards through files).

``options`` is torch's ``StateDictOptions`` (``full_state_dict`` False by default, then
``cpu_offload``, ``strict``, ``broadcast_from_rank0``, ``ignore_frozen_params``). Without
it the reference's defaults apply: full tensors, on the CPU, returned on rank 0 only
(``cpu_offload=True, rank0_only=True``), and loading skips keys it does not find
(reported in the returned missing and unexpected keys). All four are collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from . import checkpoint, normuon
from .fqn import canonical_fqn, param_names
from .full_state import full_owned, full_state_dict, gather_whole, raw_state_dict
from .meta_init import local_part
from .model_state import get_state
from .partition import whole_shape

_UNSUPPORTED = {"keep_submodule_prefixes": True, "flatten_optimizer_state_dict": False,
                "dsd_fqn_modifiers": "_fqn_modifiers"}


@dataclass(frozen=True)
class _Form:
    full: bool
    cpu_offload: bool
    rank0_only: bool
    strict: bool
    broadcast_from_rank0: bool = False
    ignore_frozen: bool = False


def _form(options, cpu_offload: bool, rank0_only: bool, loading: bool) -> _Form:
    if options is None:
        return _Form(full=True, cpu_offload=bool(cpu_offload), rank0_only=bool(rank0_only),
                     strict=not loading)
    if not (cpu_offload and rank0_only):
        raise ValueError("pass options=StateDictOptions(...) or the reference's "
                         "cpu_offload/rank0_only keywords, not both")
    for name, default in _UNSUPPORTED.items():
        if getattr(options, name) != default:
            raise ValueError(f"StateDictOptions.{name} is not supported for a dedicated "
                             "model; keys are the model's own FQNs")
    if options.cpu_offload and not options.full_state_dict:
        raise ValueError("cpu_offload applies to full state dicts here: pass "
                         "full_state_dict=True, or save shards with dmuon.checkpoint")
    full = options.full_state_dict
    return _Form(full, options.cpu_offload, full and options.cpu_offload, options.strict,
                 options.broadcast_from_rank0, options.ignore_frozen_params)


def _deliver(tree, form: _Form):
    """torch's rule: a full state dict offloaded to the CPU reaches rank 0 only."""
    if form.rank0_only and dist.get_rank() != 0:
        return {}
    if not form.cpu_offload:
        return tree
    if isinstance(tree, dict):
        return {k: _deliver(v, form) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_deliver(v, form) for v in tree]
    return tree.cpu() if isinstance(tree, torch.Tensor) else tree


def _frozen_keys(model: nn.Module) -> set[str]:
    return {canonical_fqn(n) for n, p in model.named_parameters() if not p.requires_grad}


def get_model_state_dict(model: nn.Module, *, options=None, cpu_offload: bool = True,
                         rank0_only: bool = True) -> dict:
    """The model's state dict, full or this rank's share (see the module docstring)."""
    form = _form(options, cpu_offload, rank0_only, loading=False)
    if not form.full:
        return checkpoint.model_share(model)
    sd = full_state_dict(model)
    if form.ignore_frozen:
        sd = {k: v for k, v in sd.items() if k not in _frozen_keys(model)}
    return _deliver(sd, form)


def _metadata(sd: dict, from_rank0: bool) -> dict[str, tuple]:
    """Key -> (shape, dtype) of the tensors to load; rank 0's, with broadcast_from_rank0."""
    meta = {k: (tuple(v.shape), v.dtype) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    if from_rank0:
        box = [meta]
        dist.broadcast_object_list(box, src=0)
        meta = box[0]
    return meta


def _values(sd: dict, meta: dict, from_rank0: bool, device):
    """(key, full tensor) one at a time; broadcast from rank 0 when asked to."""
    for key, (shape, dtype) in meta.items():
        if not from_rank0:
            yield key, sd[key]
            continue
        t = sd[key].to(device) if dist.get_rank() == 0 else \
            torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        yield key, t


def _whole_shapes(model: nn.Module, targets: dict) -> dict[str, tuple]:
    """Each target's shape in full (an expert-parallel param's: the whole layer's)."""
    shapes = {k: tuple(v.shape) for k, v in targets.items()}
    shapes.update({canonical_fqn(n): whole_shape(p) for n, p in model.named_parameters()
                   if canonical_fqn(n) in shapes})
    return shapes


def _check_full(meta: dict, targets: dict, strict: bool) -> tuple[list, list]:
    """Missing and unexpected keys, and every shape, checked before anything is written."""
    missing = [k for k in targets if k not in meta]
    unexpected = [k for k in meta if k not in targets]
    if strict and (missing or unexpected):
        raise RuntimeError(f"state dict does not fit the model: missing keys {missing[:8]}, "
                           f"unexpected keys {unexpected[:8]} ({len(missing)} and "
                           f"{len(unexpected)} in all); pass strict=False to load the rest")
    for key, (shape, _) in meta.items():
        if key in targets and targets[key] != shape:
            raise ValueError(f"{key}: state dict shape {shape} != model {targets[key]}")
    return missing, unexpected


def _unit_part(m, full: torch.Tensor, device) -> torch.Tensor:
    """A unit's value as this rank computes with it, from the param's full tensor."""
    value = local_part(full, m.param, device) if m.tp is not None else full.to(device)
    base = m.ep_base or 0  # expert parallelism: ``full`` holds the whole layer's experts
    return value[base + m.experts[0]:base + m.experts[1]] if m.experts else value


@torch.no_grad()
def _load_full(model: nn.Module, sd: dict, form: _Form) -> _IncompatibleKeys:
    state = get_state(model)
    targets = raw_state_dict(model)
    columns: dict[str, list] = {}
    for b in state.boundaries:
        for m in b.column:
            columns.setdefault(canonical_fqn(state.plan.params[m.fqn].param), []).append((b, m))
    dedicated = {canonical_fqn(f) for f in state.plan.param_fqns}
    meta = _metadata(sd, form.broadcast_from_rank0)
    missing, unexpected = _check_full(meta, _whole_shapes(model, targets), form.strict)
    device = state.ctx.device
    for key, full in _values(sd, meta, form.broadcast_from_rank0, device):
        if key in dedicated:
            for b, m in columns.get(key, ()):
                b.load_value(m, _unit_part(m, full, device))
        elif key in targets and hasattr(targets[key], "to_local"):
            targets[key].to_local().copy_(local_part(full, targets[key], device))
        elif key in targets:
            targets[key].copy_(full)
    for b in state.boundaries:
        b.transfer.fresh = False  # the packed buffers gather the loaded values next
    return _IncompatibleKeys(missing, unexpected)


def set_model_state_dict(model: nn.Module, model_state_dict: dict, *,
                         options=None) -> _IncompatibleKeys:
    """Load a full (pretrained weights, a single-process ``state_dict()``) or sharded
    state dict into a dedicated model; returns the missing and unexpected keys."""
    form = _form(options, True, True, loading=True)
    get_state(model).drain()  # no replicate all-gather may land on loaded values
    if not form.full:
        checkpoint.load_model_share(model, model_state_dict)
        return _IncompatibleKeys([], [])
    return _load_full(model, model_state_dict, form)


def _one(optimizers):
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise ValueError(f"a dedicated model has one dmuon.Muon optimizer, got {len(optimizers)}")
    return optimizers[0]


def _full_row_states(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """NorMuon's per-row moments in full, by key (collective; {} without NorMuon). Each
    travels broadcast to its matrix's shape, so the owners' gather, TP shards and expert
    slices included, is the momentum's; one column of the result is the state."""
    keys = {k for g, names in zip(opt.param_groups, _group_names(model, opt))
            if g.get("variant") == "normuon" for k in names}
    if not keys:
        return {}

    def broadcast(b, fqn):
        master = b.masters[fqn]
        rows = opt.state[master].get(normuon.ROW_STATE)
        return rows.expand_as(master) if rows is not None else torch.zeros_like(master)

    full = full_owned(get_state(model), broadcast)
    return {key: value[..., :1].clone() for key, value in full.items() if key in keys}


def refuse_owner_adamw(state, what: str) -> None:
    """The full optimizer dict holds Muon momentum for every dedicated param; the
    ``adamw`` route's AdamW state on owners is not in it yet."""
    routed = [a.param for a in state.plan.params.values() if a.route == "adamw"]
    if routed:
        raise NotImplementedError(
            f"{what} with params routed to 'adamw' ({routed[:3]}...): their owners' "
            "AdamW state is not in the full dict yet")


def _group_names(model: nn.Module, opt) -> list[list[str]]:
    """Each param group's param FQNs over every rank (Muon groups hold this rank's
    masters only)."""
    names = param_names(model)
    names.update({id(t): canonical_fqn(get_state(model).plan.params[u].param)
                  for u, t in get_state(model).owned_params.items()})
    mine = [sorted({names[id(p)] for p in g["params"]}) for g in opt.param_groups]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [sorted(set().union(*(r[i] for r in everyone))) for i in range(len(mine))]


def get_optimizer_state_dict(model: nn.Module, optimizers, *, options=None,
                             cpu_offload: bool = True, rank0_only: bool = True) -> dict:
    """torch's optimizer state-dict layout (``state`` by param FQN, ``param_groups`` with
    FQNs), full or this rank's share; Muon momentum comes from the owners."""
    opt, form = _one(optimizers), _form(options, cpu_offload, rank0_only, loading=False)
    if not form.full:
        return checkpoint.optimizer_share(model, opt)
    checkpoint.ensure_optimizer_state(opt)
    state = get_state(model)
    refuse_owner_adamw(state, "get_optimizer_state_dict (full)")
    momentum = full_owned(state, lambda b, fqn: opt.state[b.masters[fqn]]["momentum_buffer"])
    out = {key: {"momentum_buffer": value} for key, value in momentum.items()}
    for key, value in _full_row_states(model, opt).items():
        out[key][normuon.ROW_STATE] = value
    names = param_names(model)
    for group in opt.param_groups:
        for p in group["params"] if group["kind"] == "adamw" else ():
            out[names[id(p)]] = {k: gather_whole(v) if hasattr(v, "full_tensor") else v.clone()
                                 for k, v in opt.state[p].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": fqns}
              for g, fqns in zip(opt.param_groups, _group_names(model, opt))]
    return _deliver({"state": out, "param_groups": groups}, form)


@torch.no_grad()
def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: dict, *,
                             options=None) -> None:
    """Load a full or sharded optimizer state dict: owners take their momentum, FSDP2
    shards their slice of AdamW's state, groups their hyperparameters."""
    opt, form = _one(optimizers), _form(options, True, True, loading=True)
    if not form.full:
        checkpoint.load_optimizer_share(model, opt, optim_state_dict)
        return
    checkpoint.ensure_optimizer_state(opt)
    state, saved = get_state(model), optim_state_dict["state"]
    refuse_owner_adamw(state, "set_optimizer_state_dict (full)")
    names = param_names(model)
    targets = [(b.masters[m.fqn], m, canonical_fqn(state.plan.params[m.fqn].param))
               for b in state.boundaries for m in b.owned]
    adamw = [(p, None, names[id(p)]) for g in opt.param_groups if g["kind"] == "adamw"
             for p in g["params"]]
    lacking = [f"{key}/{k}" for p, _, key in targets + adamw for k in opt.state[p]
               if k not in saved.get(key, {})]
    if lacking:
        raise KeyError(f"optimizer state dict lacks {lacking[:8]} ({len(lacking)} in all)")
    device = state.ctx.device
    for p, m, key in targets + adamw:
        for k, dst in opt.state[p].items():
            src = saved[key][k]
            if k == normuon.ROW_STATE:  # one per row: its matrix's part, then one column
                full = src.expand_as(saved[key]["momentum_buffer"])
                dst.copy_(_unit_part(m, full, device)[..., :1])
            elif m is not None:
                dst.copy_(_unit_part(m, src, device))
            elif hasattr(dst, "to_local"):
                dst.to_local().copy_(local_part(src, dst, device))
            else:
                dst.copy_(src)
    checkpoint.load_groups(opt, optim_state_dict["param_groups"])
