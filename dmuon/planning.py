"""What a planner needs from the core, with no process group: the partition of a (meta)
model into owners, its checks against a stored plan, what a plan costs each rank (bytes
per step by mesh dim and phase, resident memory), Newton-Schulz FLOPs and the cost of NS
over tensor-parallel shards, DMuon's process groups per rank, canonical FQNs, and each
param's routing policy (``resolve_policies``). The service plans jobs with these names
only; everything else it uses is in ``dmuon`` itself."""

from __future__ import annotations

from .cost import (
    PRESENCE_BYTES,
    boundary_elements,
    column_elements,
    exact,
    gathered_elements,
    ledger_prediction,
    memory_prediction,
    packed_peak_bytes,
    presence_flags,
)
from .fqn import canonical_fqn
from .model_state import is_dedicated
from .newton_schulz import gram_matmuls, ns_flops, restart_index
from .partition import Assignment, DedicationPlan, PlanMismatch, check_plan, model_entries
from .precision import boundary_precision
from .process_groups import COMMUNICATOR_BYTES, communicators_per_rank
from .routing import owner_adamw, resolve_policies, routed_predicate
from .tp import GATHER, GRAM_ALLREDUCE, mode_of, ns_bytes, peer_ns_flops

__all__ = [
    "Assignment", "COMMUNICATOR_BYTES", "DedicationPlan", "GATHER", "GRAM_ALLREDUCE",
    "PRESENCE_BYTES", "PlanMismatch", "boundary_dtypes", "boundary_elements",
    "canonical_fqn", "check_plan", "column_elements", "communicators_per_rank",
    "exact", "gathered_elements", "gram_matmuls", "is_dedicated", "ledger_prediction",
    "memory_prediction", "mode_of", "model_entries", "ns_bytes", "ns_flops",
    "packed_peak_bytes", "peer_ns_flops", "presence_flags", "resolve_policies",
    "restart_index",
]


def boundary_dtypes(model, *, predicate, param_policy=None, hook_boundary_predicate=None,
                    hook_boundary_strict: bool = True) -> dict[str, tuple]:
    """Each hook boundary's own ``(param_dtype, grad_dtype)`` from ``param_policy`` (a
    field None where the policy sets none), as ``dedicate_params`` gives its packed
    buffer and its reduce; boundaries the policy leaves alone are absent."""
    policies = resolve_policies(model, predicate, param_policy)
    entries = model_entries(model, routed_predicate(predicate, policies),
                            hook_boundary_predicate, hook_boundary_strict,
                            owner_adamw(policies), allow_empty=True)
    return {b: tuple(fields[:2]) for b, fields in boundary_precision(entries, policies).items()
            if any(f is not None for f in fields[:2])}
