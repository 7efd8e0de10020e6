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
from .process_groups import COMMUNICATOR_BYTES, communicators_per_rank
from .routing import resolve_policies
from .tp import GATHER, GRAM_ALLREDUCE, mode_of, ns_bytes, peer_ns_flops

__all__ = [
    "Assignment", "COMMUNICATOR_BYTES", "DedicationPlan", "GATHER", "GRAM_ALLREDUCE",
    "PRESENCE_BYTES", "PlanMismatch", "boundary_elements", "canonical_fqn", "check_plan",
    "column_elements", "communicators_per_rank",
    "exact", "gathered_elements", "gram_matmuls", "is_dedicated", "ledger_prediction",
    "memory_prediction", "mode_of", "model_entries", "ns_bytes", "ns_flops",
    "packed_peak_bytes", "peer_ns_flops", "presence_flags", "resolve_policies",
    "restart_index",
]
