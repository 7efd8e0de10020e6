"""Composition with FSDP2 through its public API.

Dedicated params reach FSDP2 as ``ignored_params`` (not sharded, gradients not reduced:
exactly what DMuon needs). ``dmuon.fully_shard`` adds them, and hands FSDP2's
``mp_policy`` to DMuon so one mixed-precision policy covers both kinds of params.
Importing dmuon rebinds the public name ``torch.distributed.fsdp.fully_shard`` to it, as
the seeds' set-up order (``import dmuon``, ``dedicate_params``, ``fully_shard``) expects;
passing ``ignored_params=dmuon.ignored_params(model)`` works the same. No FSDP2
function is replaced: FSDP2's own stays where it is defined.

Tensor parallelism's public ``distribute_module`` is wrapped at import too: applied
after ``dedicate_params`` it would read the placeholders' freed storage and fail with a
storage-size error that names nothing; the wrapper refuses by the param's name instead.
"""

from __future__ import annotations

import functools

from torch import nn

from .dedicate import dedicate_params
from .model_state import is_dedicated
from .precision import fsdp_policy


def _skipping_dedicated(fsdp_fully_shard):
    """FSDP2's ``fully_shard`` with the module's dedicated params added to
    ``ignored_params``; a ``mp_policy`` also becomes DMuon's for the boundaries inside."""

    @functools.wraps(fsdp_fully_shard)
    def fully_shard(module, *, ignored_params: set | None = None, **kwargs):
        modules = (module,) if isinstance(module, nn.Module) else tuple(module)
        dedicated = {p for m in modules for p in m.parameters() if is_dedicated(p)}
        policy = fsdp_policy(modules, kwargs.get("mp_policy"))
        if policy is not None:
            kwargs["mp_policy"] = policy
        if dedicated and policy is not None:
            state = next(iter(dedicated))._dmuon_owner_state
            state.adopt_mp_policy(policy)
        return fsdp_fully_shard(module, ignored_params=set(ignored_params or ()) | dedicated,
                                **kwargs)

    fully_shard.__module__ = __name__
    fully_shard.__doc__ = (
        "``torch.distributed.fsdp.fully_shard`` with ``module``'s dedicated params added "
        "to ``ignored_params`` and its ``mp_policy`` handed to DMuon; takes and returns "
        "what FSDP2's does.\n\n" + (fsdp_fully_shard.__doc__ or ""))
    fully_shard._dmuon_skips_dedicated = True
    return fully_shard


def _fsdp2_fully_shard():
    from torch.distributed import fsdp

    current = fsdp.fully_shard
    return current.__wrapped__ if getattr(current, "_dmuon_skips_dedicated", False) else current


fully_shard = _skipping_dedicated(_fsdp2_fully_shard())


def install_fully_shard() -> None:
    """The seeds' contract: after ``import dmuon``, ``torch.distributed.fsdp.fully_shard``
    skips dedicated params. The public name is rebound to ``dmuon.fully_shard``; FSDP2's
    own function (and every private one) stays as it is, so a ``fully_shard`` bound
    before ``import dmuon`` is FSDP2's: ``check_dedicated`` then names the param."""
    from torch.distributed import fsdp

    fsdp.fully_shard = fully_shard


def install_patch() -> None:
    """The reference's name for what ``import dmuon`` does (idempotent): the public
    ``torch.distributed.fsdp.fully_shard`` skips dedicated params, TP's
    ``distribute_module`` refuses them, TP plans are counted. No FSDP2 function is
    replaced (its ``_get_managed_states`` stays FSDP2's)."""
    from .tp_traffic import install_tp_traffic_counters

    install_fully_shard()
    guard_tensor_parallel()
    install_tp_traffic_counters()


def _replicate_layout(mesh):
    """A 1-D data-parallel mesh as the R x 1 (replicate, shard) layout of the same ranks.
    Under tensor parallelism ``mesh`` is one of several data-parallel rows (one per TP
    coordinate): every rank builds one mesh of all the rows, so that each makes the
    same groups in the same order, and takes its own row's layout."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if mesh.ndim != 1:
        raise ValueError(f"the DDP composition takes a 1-D data-parallel mesh, got "
                         f"{mesh.ndim}-D {mesh.mesh_dim_names}; for HSDP use dedicate_params")
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mesh.mesh.flatten().tolist())
    rows = sorted({tuple(r) for r in rows})
    if len(rows) == 1:
        return DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, 1),
                          mesh_dim_names=("replicate", "shard"))
    everyone = DeviceMesh(mesh.device_type, torch.tensor(rows).reshape(len(rows), -1, 1),
                          mesh_dim_names=("row", "replicate", "shard"))
    return everyone["replicate", "shard"]


def dedicate_params_ddp(model: nn.Module, mesh, predicate, *, compute_dtype=None,
                        hook_boundary_predicate=None, hook_boundary_strict: bool = True,
                        mp_policy=None, param_policy=None, param_policy_fn=None,
                        route_hint_fn=None, process_group_policy: str | None = None):
    """Dedicated ownership without sharding (the reference's DDP composition): every rank
    keeps every matrix, one owner per matrix among all ranks receives its averaged
    gradient, runs NS alone and sends the update to the others. It is the R x 1 layout
    of ``mesh``'s ranks (DMuon-Z2 on a shard group of one); ``dmuon.replicate(model)``
    then replicates the other params. ``param_policy``, ``param_policy_fn``,
    ``route_hint_fn`` and ``process_group_policy``: as ``dedicate_params`` takes them."""
    layout = _replicate_layout(mesh)
    plan = dedicate_params(model, layout["shard"], predicate, replicate_mesh=layout["replicate"],
                           reshard_after_forward=False, compute_dtype=compute_dtype,
                           hook_boundary_predicate=hook_boundary_predicate,
                           hook_boundary_strict=hook_boundary_strict, mp_policy=mp_policy,
                           param_policy=param_policy, param_policy_fn=param_policy_fn,
                           route_hint_fn=route_hint_fn,
                           process_group_policy=process_group_policy)
    model._dmuon_ddp_layout = layout
    return plan


def dedicate_params_ddp_tp(model: nn.Module, mesh, predicate, **kwargs):
    """The reference's DDP + TP entry: ``dedicate_params_ddp`` with ``mesh`` the
    data-parallel row of a (dp, tp) mesh, TP applied first. Dedicated TP shards keep an
    owner per data-parallel row; their NS talks over the TP group (``dmuon.tp``), as
    under ``dedicate_params``. ``dedicate_params_ddp`` takes them the same way."""
    return dedicate_params_ddp(model, mesh, predicate, **kwargs)


def replicate_tp(model: nn.Module, mesh=None, **kwargs):
    """The reference's companion of ``dedicate_params_ddp_tp``: ``replicate`` the params
    DMuon left out. A TP-sharded one among them is refused: route it to DMuon."""
    from torch.distributed.tensor import DTensor

    shards = [n for n, p in model.named_parameters()
              if isinstance(p, DTensor) and not is_dedicated(p)]
    if shards:
        raise ValueError(f"replicate_tp: {shards[:3]} are TP shards outside DMuon; route "
                         "them to 'muon' or 'adamw' (dedicate_params_ddp_tp's predicate "
                         "or param_policy)")
    return replicate(model, mesh, **kwargs)


def replicate(model: nn.Module, mesh=None, **kwargs):
    """The params ``dedicate_params_ddp`` left out, replicated with gradients averaged
    over the ranks as DDP does: FSDP2 on the R x 1 layout, which shards nothing (one
    all-reduce per step; takes FSDP2's other keywords, e.g. ``mp_policy``)."""
    layout = getattr(model, "_dmuon_ddp_layout", None)
    if layout is None:
        raise RuntimeError("dmuon.replicate(model) follows dmuon.dedicate_params_ddp(model, "
                           "mesh, predicate)")
    if mesh is not None and mesh.mesh.flatten().tolist() != layout.mesh.flatten().tolist():
        raise ValueError("dmuon.replicate: mesh differs from the one dedicate_params_ddp used")
    return fully_shard(model, mesh=layout, reshard_after_forward=False, **kwargs)


def _refusing_dedicated(distribute_module):
    @functools.wraps(distribute_module)
    def wrapper(module, *args, **kwargs):
        for p in module.parameters():
            if is_dedicated(p):
                raise RuntimeError(
                    f"tensor parallelism applied to '{p._dmuon_dedicated}' after "
                    "dmuon.dedicate_params; apply TP first, then dedicate_params, then "
                    "fully_shard")
        return distribute_module(module, *args, **kwargs)

    wrapper._dmuon_guard = True
    return wrapper


def guard_tensor_parallel() -> None:
    from torch.distributed.tensor.parallel import style

    if not getattr(style.distribute_module, "_dmuon_guard", False):
        style.distribute_module = _refusing_dedicated(style.distribute_module)
