"""Meta-device models: materialise only what each rank keeps, initialised per FQN.

Build the model on ``torch.device("meta")``, call ``dedicate_params`` and
``fully_shard``, then ``dmuon.materialize(model, seed=...)``. FSDP2's shards and the
buffers come from ``model.to_empty`` as FSDP2 documents it, with the dedicated params
kept out of it (they would otherwise be allocated in full on every rank); the owners'
values live in DMuon's column values and masters, which exist only on the ranks that
keep them.

Initialisation is deterministic per module FQN, whatever the layout: each unit of
initialisation runs on full-size CPU temporaries of its params under
``torch.manual_seed(unit_seed(seed, fqn))``, and every rank then keeps its part (its
column's matrices, its FSDP2 shard). The rule, per module in ``named_modules`` order:
``init_fn(module)`` when given (Hugging Face's ``model._init_weights`` fits); else a
non-root module's own ``init_weights()`` (torchtitan's per-block convention; its whole
subtree is one unit); else ``module.reset_parameters()``. A module with params and no
rule is refused by name. At most one unit's params exist in full at a time.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from torch import nn

from .dedicate import leave_meta
from .model_state import check_dedicated, get_state, is_dedicated
from .partition import whole_shape


def unit_seed(seed: int, fqn: str) -> int:
    """The seed of one unit of initialisation: a hash of the run's seed and its FQN."""
    digest = hashlib.blake2b(f"{seed}:{fqn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_units(model: nn.Module, init_fn=None):
    """``(fqn, module, rule, params)`` for each unit of initialisation, in order; ``params``
    are ``(owner module, attribute, param)`` triples."""
    skip: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if skip and (name + ".").startswith(skip):
            continue
        subtree = init_fn is None and name != "" and callable(getattr(module, "init_weights", None))
        params = [(m, attr, p) for m_name, m in (module.named_modules() if subtree
                                                 else [("", module)])
                  for attr, p in m.named_parameters(recurse=False)]
        if subtree:
            skip = (*skip, name + ".")
            yield name, module, module.init_weights, params
        elif init_fn is not None:
            if params or list(module.buffers(recurse=False)):
                yield name, module, lambda m=module: init_fn(m), params
        elif params:
            rule = getattr(module, "reset_parameters", None)
            if rule is None:
                raise ValueError(
                    f"module '{name or '<root>'}' ({type(module).__name__}) has params "
                    f"{[a for _, a, _ in params]} but no reset_parameters(); give it one, or "
                    "pass init_fn to dmuon.materialize")
            yield name, module, rule, params


@contextlib.contextmanager
def _swapped(params, temporaries):
    """The unit's params replaced by full-size temporaries, restored afterwards."""
    for (module, attr, p), tmp in zip(params, temporaries):
        setattr(module, attr, nn.Parameter(tmp, requires_grad=p.requires_grad))
    try:
        yield
    finally:
        for module, attr, p in params:
            setattr(module, attr, p)


def local_part(full: torch.Tensor, param, device) -> torch.Tensor:
    """This rank's part of a DTensor param (FSDP2 shard, TP shard), sliced locally."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(device), param.device_mesh, param.placements,
                             src_data_rank=None).to_local()


def _keep(state, p, full: torch.Tensor, column_of: dict) -> None:
    """Copy what this rank keeps of ``p``'s initial value ``full``."""
    device = state.ctx.device
    if is_dedicated(p):
        value = local_part(full, p, device) if hasattr(p, "placements") else full
        for b, m in column_of.get(id(p), ()):
            lo, hi = m.experts or (0, 0)
            base = m.ep_base or 0  # an expert-parallel param: ``full`` is the whole layer
            b.load_value(m, value[base + lo:base + hi] if m.experts else value)
    elif hasattr(p, "to_local"):
        p.to_local().copy_(local_part(full, p, device))
    else:
        p.copy_(full)


def _needed(p, column_of) -> bool:
    return not is_dedicated(p) or id(p) in column_of


@torch.no_grad()
def _initialise(model: nn.Module, state, seed: int, init_fn) -> None:
    column_of: dict[int, list] = {}
    for b in state.boundaries:
        for m in b.column:
            column_of.setdefault(id(m.param), []).append((b, m))
    for name, _module, rule, params in init_units(model, init_fn):
        if params and not any(_needed(p, column_of) for _, _, p in params):
            continue  # nothing of it stays here: skip the work (units seed independently)
        temporaries = [torch.empty(whole_shape(p), dtype=p.dtype) for _, _, p in params]
        with torch.random.fork_rng(devices=[]), _swapped(params, temporaries):
            torch.manual_seed(unit_seed(seed, name))
            rule()
        for (_, _, p), tmp in zip(params, temporaries):
            if _needed(p, column_of):
                _keep(state, p, tmp, column_of)


@contextlib.contextmanager
def _dedicated_params_detached(model: nn.Module):
    """The dedicated params taken out of their modules, and put back as the same
    objects: ``to_empty`` would allocate them in full on every rank, and it replaces a
    tensor subclass's (a TP shard's DTensor) content by ``swap_tensors``, which takes its
    marks and autograd hooks along."""
    slots = [(module, attr, p) for module in model.modules()
             for attr, p in module._parameters.items() if p is not None and is_dedicated(p)]
    for module, attr, _ in slots:
        module._parameters[attr] = None
    try:
        yield
    finally:
        for module, attr, p in slots:
            module._parameters[attr] = p


def _to_empty_except_dedicated(model: nn.Module, state) -> None:
    """``model.to_empty`` for FSDP2 shards and buffers, the dedicated params left out;
    they view DMuon's buffers again afterwards. Buffers that had values keep them
    (``to_empty`` would leave them uninitialised)."""
    device = state.ctx.device
    kept = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
    with _dedicated_params_detached(model):
        model.to_empty(device=device)
    for b in state.boundaries:
        b.bind_views()
        b.free()
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for n, value in kept.items():
            buffers[n].copy_(value)


def materialize(model: nn.Module, *, seed: int = 0, init_fn=None) -> None:
    """Allocate and initialise a model dedicated (and fully sharded) on the meta device;
    collective only in that every rank must call it. See the module docstring."""
    state = get_state(model)
    check_dedicated(state)
    leave_meta(state)
    _to_empty_except_dedicated(model, state)
    _initialise(model, state, seed, init_fn)
    state.mark_initialised()


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int = 0, init_fn=None) -> None:
    """Initialise a whole, undistributed model in place by the rule ``materialize`` uses,
    so that a single process holds exactly the values a dedicated run starts from."""
    for name, _module, rule, _params in init_units(model, init_fn):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(unit_seed(seed, name))
            rule()
