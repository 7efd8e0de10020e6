"""DMuon: distributed Muon with dedicated ownership, composed with FSDP2.

Each Muon-target matrix gets one *owner* rank that keeps it in full, receives its
averaged gradient by a reduce and runs Newton-Schulz alone; every other rank holds a
zero-storage placeholder that a broadcast fills before the matrix's hook boundary runs.

Public API (setup order: TP, ``dedicate_params``, ``fully_shard``)::

    plan = dmuon.dedicate_params(model, mesh, predicate=lambda n, p: ...,
                                 reshard_after_forward=True)   # Z3; False = Z2
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02, ...)                      # torch.optim.Optimizer

- ``dedicate_params(model, mesh, *, predicate, replicate_mesh=None,
  reshard_after_forward=True, hook_boundary_predicate=None, hook_boundary_strict=True)``
- ``partition(model, *, predicate, shard_size, replicate_size=1, ...)``: the same plan
  without a process group (meta-device models).
- ``get_plan(model)``: the ``DedicationPlan`` (owner per FQN, elements and NS FLOPs per
  rank, imbalance, ``table()``).
- ``Muon(model, ...)``: Muon on owned matrices, ``torch.optim.AdamW`` for the rest.
- ``newton_schulz(G, steps, backend="gram", coefficients, dtype, restart=True,
  gram_dtype=None)``, ``ns_flops(shape, steps, backend, restart)``.
- ``full_state_dict(model)``: every tensor in full on every rank (collective).
- ``no_sync(model)``: accumulate gradients without reducing (FSDP2's
  ``set_requires_gradient_sync`` works too); ``clip_grad_norm_(model, max_norm)``.
- ``checkpoint.save/load(path, model, optimizer, extra=None)`` and
  ``checkpoint.get_state_dict/set_state_dict``: sharded DCP checkpoints that load on any
  layout.
- ``get_ledger(model)``: bytes per step by mesh dim and phase; ``memory_report(model,
  optimizer)``: live bytes by kind.

Importing this package makes FSDP2's ``fully_shard`` skip dedicated params and
refuses tensor parallelism applied after ``dedicate_params``.
"""

from . import _compose, checkpoint
from .comm import Ledger
from .dedicate import dedicate_params, full_state_dict, get_plan, get_state
from .grads import clip_grad_norm_, no_sync
from .newton_schulz import newton_schulz, ns_flops
from .optim import Muon
from .partition import Assignment, DedicationPlan, partition
from .stats import MEMORY_KINDS, memory_report

_compose.install()


def get_ledger(model) -> Ledger:
    """The byte ledger of a dedicated model (``last_step(dim, phase)`` after each step)."""
    return get_state(model).ledger


__all__ = [
    "Assignment",
    "DedicationPlan",
    "Ledger",
    "MEMORY_KINDS",
    "Muon",
    "checkpoint",
    "clip_grad_norm_",
    "dedicate_params",
    "full_state_dict",
    "get_ledger",
    "get_plan",
    "memory_report",
    "newton_schulz",
    "no_sync",
    "ns_flops",
    "partition",
]
