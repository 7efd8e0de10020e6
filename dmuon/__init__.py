"""DMuon: distributed Muon with dedicated ownership, composed with FSDP2.

Each Muon-target matrix gets one *owner* rank that keeps it in full, receives its
averaged gradient by a reduce-scatter and runs Newton-Schulz alone; every other rank
holds a zero-storage placeholder that an all-gather fills before the matrix's hook
boundary runs.

Public API (set-up order: TP, ``dedicate_params``, ``fully_shard``)::

    plan = dmuon.dedicate_params(model, mesh, predicate=lambda n, p: ...,
                                 reshard_after_forward=True)   # Z3; False = Z2
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh)                     # FSDP2, dedicated params ignored
    dmuon.fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02, ...)                      # torch.optim.Optimizer

- ``dedicate_params(model, mesh, predicate, *, replicate_mesh=None,
  reshard_after_forward=True, hook_boundary_predicate=None, hook_boundary_strict=True,
  mp_policy=None, compute_dtype=None, prefetch=1, plan=None)``; the model may be on the
  meta device, then ``materialize(model, seed=..., init_fn=None)`` allocates and
  initialises it. ``plan``: a stored ``DedicationPlan`` (or its ``to_dict()``) to apply
  instead of partitioning, refused with ``PlanMismatch`` when the model or mesh differs.
  Non-matrix params the predicate selects go to AdamW (one warning names them).
  ``mp_policy``/``compute_dtype`` given here are DMuon's own policy; otherwise the first
  ``fully_shard(mp_policy=...)`` over a hook boundary is.
  ``dedicate_params_ddp(model, mesh, predicate)`` + ``replicate(model)``: the DDP
  composition (the R x 1 layout); ``dedicate_params_ddp_tp`` + ``replicate_tp``: the
  same with TP applied first (``mesh`` the data-parallel row of a (dp, tp) mesh).
  Pure DMuon: ``param_policy={"defaults": {...}, "overrides": [{"name": [...], "set":
  {...}}]}`` (or ``param_policy_fn(name, param)``, or the legacy ``route_hint_fn``) routes
  each selected param to ``"muon"``, ``"adamw"`` (owner broadcast/reduce, AdamW on the
  owner) or ``"sharded_adamw"`` (FSDP2's shards); ``DMuonParamPolicy`` is one param's
  resolved policy (``dmuon.get_state(model).policies``). Optimizer groups carry
  ``dmuon_route``; a user group's ``dmuon_route`` (``dmuon_optimizer``,
  ``matrix_optimizer``) forces "muon" or "adamw" on its dedicated params.
- ``fully_shard(module, **fsdp_kwargs)``: FSDP2's, with the dedicated params in
  ``ignored_params`` (or pass ``ignored_params=dmuon.ignored_params(model)`` yourself).
- ``partition(model, *, predicate, shard_size, replicate_size=1, ...)``: the same plan
  without a process group (meta-device models).
- ``get_plan(model)``: the ``DedicationPlan`` (owner per FQN, elements and NS FLOPs per
  rank, imbalance, ``table()``; also a mapping param -> owner rank);
  ``get_dedicated_params(model)``, ``get_owned_params(model, rank)``.
- ``Muon(model_or_param_groups, ..., param_groups=None, skip_nonfinite=True)``: Muon on
  owned matrices, ``torch.optim.AdamW`` for the rest (each group's ``kind`` and
  ``use_muon`` say which); ``zero_grad`` drops every gradient
  DMuon holds for the step; a non-finite step is skipped on every rank.
- ``newton_schulz(G, steps, backend="gram", coefficients, dtype, restart=True,
  gram_dtype=None)``, ``ns_flops(shape, steps, backend, restart)``. The reference's
  ``NewtonSchulz(backend="gram", kernel="auto", coefficients=None,
  restart_iterations=None, deterministic=False)`` for ``Muon(ns_backend=...)`` (its
  coefficients count the iterations), ``gram_newton_schulz(G, ...)``,
  ``get_ns_backend()`` and ``get_backend_status()`` (``dmuon.ns_backends``).
- ``full_state_dict(model)``: every tensor in full on every rank (collective).
- ``no_sync(model)``: accumulate gradients without reducing; ``clip_grad_norm_(model or
  optimizer, max_norm)``; ``wait_all_reduces(model)``; ``wait_all_replicate_broadcasts(
  model)`` (also ``wait_all_post_step_broadcasts``): HSDP's post-step all-gathers landed.
  ``clip_grad_norm_(..., strategy="global_norm")``: the reference's Muon-only clip,
  returning ``MuonGradClipStats``; ``register_muon_grad_clip_strategy(name, fn)``.
  ``clip_grad_norm_buckets_([GradClipBucket(name, grads), ...], max_norm)``: each
  bucket clipped by its own norm (``SegmentedGradClipResult`` of
  ``GradClipBucketStats``); ``try_clip_optimizer_grad_norm_buckets_(optimizer,
  regular_grads=, adamw_grads=, max_norm=)`` (``dmuon.clip_buckets``).
  ``prepare_muon_grads(model)`` (``wait_all_reduces``), ``broadcast_all_updates(model)``
  and ``broadcast_all_updates_async(model)``: the owners' current values published to
  every replica (``step()`` does it itself); ``install_patch()``: what the import does.
  ``dmuon.utils`` holds these and ``get_dedicated_params``/``get_owned_params`` under the
  reference's module name.
- ``checkpoint.save/load(path, model, optimizer, extra=None)`` and
  ``checkpoint.get_state_dict/set_state_dict``: sharded DCP checkpoints that load on any
  layout; ``get/set_model_state_dict``, ``get/set_optimizer_state_dict``:
  torch.distributed.checkpoint.state_dict's, full or sharded (docs/migration.md).
- ``qk_clip``: MuonClip's QK-clip, ``Muon(..., qk_clip=tau)``; an attention module
  takes part by naming its q/k weights in ``qk_clip_weights`` and calling
  ``qk_clip.record_max_logits(self, q, k)`` in its forward.
- ``dedicate_stage``, ``PipelineStage``, ``PipelineMuon``: pipeline parallelism under
  ``torch.distributed.pipelining`` (``dmuon.pipeline``).
- Diagnostics, rank-local and JSON-friendly (``dmuon.diagnostics``):
  ``summarize_param_groups(model, optimizer)`` (routes, groups, one row per param),
  ``summarize_comm_plan(model)`` (per boundary: owners, bytes per gather),
  ``get_comm_ctx(model)`` (a ``DedicatedCommContext``), ``collect_forward_unshard_profile(
  model)`` (the last step's forward gather bytes).
- ``get_ledger(model)``: bytes per step by mesh dim and phase; ``memory_report(model,
  optimizer)``: live bytes by kind.

Importing this package replaces no FSDP2 function. It rebinds the public name
``torch.distributed.fsdp.fully_shard`` to ``dmuon.fully_shard`` (the seeds' contract:
plain ``fully_shard`` after ``import dmuon`` skips dedicated params), and wraps tensor
parallelism's public ``distribute_module`` so that TP applied after ``dedicate_params``
is refused by name.
"""

from . import checkpoint, qk_clip, utils
from .clip_buckets import (
    GradClipBucket,
    GradClipBucketStats,
    SegmentedGradClipResult,
    clip_grad_norm_buckets_,
    try_clip_optimizer_grad_norm_buckets_,
)
from .comm import Ledger
from .compose import (
    dedicate_params_ddp,
    dedicate_params_ddp_tp,
    fully_shard,
    guard_tensor_parallel,
    install_fully_shard,
    install_patch,
    replicate,
    replicate_tp,
)
from .dcp_state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from .dedicate import dedicate_params
from .diagnostics import (
    DedicatedCommContext,
    collect_forward_unshard_profile,
    get_comm_ctx,
    summarize_comm_plan,
    summarize_param_groups,
)
from .expert_dispatch import RowGroups, dispatch_combine, grouped_linear, grouped_mm_fits
from .expert_parallel import shard_experts
from .full_state import full_state_dict
from .grads import clip_grad_norm_, no_sync
from .meta_init import init_weights, materialize, unit_seed
from .model_state import (
    get_dedicated_params,
    get_owned_params,
    get_plan,
    get_state,
    ignored_params,
    wait_all_post_step_broadcasts,
    wait_all_reduces,
    wait_all_replicate_broadcasts,
)
from .muon_clip import MuonGradClipStats, register_muon_grad_clip_strategy
from .newton_schulz import POLAR_EXPRESS_COEFFICIENTS, YOU_COEFFICIENTS, newton_schulz, ns_flops
from .ns_backends import NewtonSchulz, get_backend_status, get_ns_backend, gram_newton_schulz
from .optim import Muon, adjusted_lr
from .partition import Assignment, DedicationPlan, PlanMismatch, partition
from .pipeline import PipelineMuon, PipelineStage, dedicate_stage
from .post_step import broadcast_all_updates, broadcast_all_updates_async, prepare_muon_grads
from .routing import DMuonParamPolicy
from .stats import MEMORY_KINDS, communicator_report, memory_report
from .tp_traffic import install_tp_traffic_counters

guard_tensor_parallel()
install_fully_shard()
install_tp_traffic_counters()


def get_ledger(model) -> Ledger:
    """The byte ledger of a dedicated model (``last_step(dim, phase)`` after each step)."""
    return get_state(model).ledger


# What users call, and the types its answers come in: ``get_plan`` gives a DedicationPlan
# of Assignments, ``get_ledger`` a Ledger, ``memory_report`` counts by MEMORY_KINDS, a
# stored plan that does not fit is refused with PlanMismatch. ``dmuon.testing`` (the gloo
# launcher of the tests and benchmarks) is imported on its own.
__all__ = [
    "replicate_tp",
    "dedicate_params_ddp_tp",
    "summarize_param_groups",
    "summarize_comm_plan",
    "get_comm_ctx",
    "collect_forward_unshard_profile",
    "DedicatedCommContext",
    "prepare_muon_grads",
    "install_patch",
    "broadcast_all_updates_async",
    "broadcast_all_updates",
    "try_clip_optimizer_grad_norm_buckets_",
    "register_muon_grad_clip_strategy",
    "clip_grad_norm_buckets_",
    "SegmentedGradClipResult",
    "MuonGradClipStats",
    "GradClipBucketStats",
    "GradClipBucket",
    "Assignment",
    "DMuonParamPolicy",
    "DedicationPlan",
    "Ledger",
    "MEMORY_KINDS",
    "communicator_report",
    "Muon",
    "NewtonSchulz",
    "POLAR_EXPRESS_COEFFICIENTS",
    "PipelineMuon",
    "PipelineStage",
    "PlanMismatch",
    "RowGroups",
    "YOU_COEFFICIENTS",
    "adjusted_lr",
    "checkpoint",
    "clip_grad_norm_",
    "dedicate_params",
    "dedicate_params_ddp",
    "dedicate_stage",
    "dispatch_combine",
    "full_state_dict",
    "fully_shard",
    "get_dedicated_params",
    "get_ledger",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_owned_params",
    "get_backend_status",
    "get_ns_backend",
    "get_plan",
    "gram_newton_schulz",
    "grouped_linear",
    "grouped_mm_fits",
    "ignored_params",
    "init_weights",
    "materialize",
    "memory_report",
    "newton_schulz",
    "no_sync",
    "ns_flops",
    "partition",
    "qk_clip",
    "replicate",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "shard_experts",
    "unit_seed",
    "utils",
    "wait_all_post_step_broadcasts",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]
