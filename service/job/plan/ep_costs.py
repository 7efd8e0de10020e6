"""What expert parallelism (``layout.ep``) costs a plan: the EP degree a spec resolves to
on a shard size, and the ``ep`` dim's bytes per step.

The EP group is P consecutive shard ranks (``dmuon.shard_experts``): with the tp ranks
innermost and the shard ranks next, the two heaviest dims stay inside a host whenever
P x T ranks do, and only the shard dim's gathers (under FSDP over hosts) and the
replicate dim cross hosts.

The bytes follow the ledger's model of ``dmuon.dispatch_combine`` (its docstring): an
all-to-all whose input on a rank is S bytes counts (P-1)/P x S. Per MoE layer and
micro-batch, a rank's n tokens make n x k rows of ``hidden`` activations; with routing
spread evenly (what a planner can know) each rank receives as many rows as it sends. The
forward sends the E row counts (int64), the rows, and the experts' outputs back; the
backward sends the two gradients; activation checkpointing runs the forward again
(phase ``recompute``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from torch import nn

from dmuon import planning

from ..models.experts import experts_per_token, is_expert
from ..spec import JobSpec, SpecError


@dataclass(frozen=True)
class MoEShape:
    """The model's MoE layers as EP sees them; ``layers`` 0 for a dense model."""

    layers: int = 0
    experts: int = 0
    top_k: int = 0
    hidden: int = 0


def moe_shape(model: nn.Module, predicate) -> MoEShape:
    """The MoE layers of a whole (uncut) model: its expert-parallel Muon params."""
    owners = {name.rpartition(".")[0]: p for name, p in model.named_parameters()
              if p.ndim == 3 and predicate(name, p) and is_expert(name, p)}
    if not owners:
        return MoEShape()
    counts = {int(p.shape[0]) for p in owners.values()}
    if len(counts) > 1:
        raise SpecError(f"layout.ep: MoE layers with different expert counts {sorted(counts)}")
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "dim", 0)
    return MoEShape(len(owners), counts.pop(), int(experts_per_token(model) or 0),
                    int(hidden))


def resolve_ep(spec: JobSpec, shard: int, moe: MoEShape) -> int:
    """P: the spec's ``layout.ep``, checked against the shard size and the experts, or for
    ``auto`` the largest P dividing both (1 for a dense model)."""
    ep = spec.layout.ep
    if ep == "auto":
        return max((p for p in range(1, shard + 1)
                    if shard % p == 0 and moe.experts % p == 0), default=1) \
            if moe.layers else 1
    if ep > 1 and not moe.layers:
        raise SpecError(f"layout.ep = {ep}: the model has no MoE experts (3-D weights of "
                        "a module named 'experts') to split")
    if shard % ep:
        raise SpecError(f"layout.ep = {ep} does not divide the shard size N = {shard}: the "
                        "EP group is P consecutive shard ranks")
    if moe.layers and moe.experts % ep:
        raise SpecError(f"layout.ep = {ep} does not divide the model's {moe.experts} "
                        "experts per MoE layer")
    if ep > 1 and not (moe.top_k and moe.hidden):
        raise SpecError(f"layout.ep = {ep}: the model's config names no top_k "
                        "(num_experts_per_tok or top_k) and hidden size (hidden_size or "
                        "dim), which the planner's token traffic needs")
    return ep


def check_ep_boundaries(model: nn.Module, split, ep: int) -> None:
    """Refuse hook boundaries that hold experts and other Muon params under EP: the
    workers could not lay them out (``dmuon.dedicate_params`` refuses such a boundary),
    so the spec that set them is told now. ``split``: the model's ``ParamSplit``."""
    if ep == 1:  # a dense layout keeps nothing apart: the model is not walked again
        return
    experts = {n for n, p in model.named_parameters() if is_expert(n, p)}
    kinds: dict[str, set[bool]] = {}
    for fqn, _, boundary in planning.model_entries(model, split.predicate,
                                                   split.boundary_predicate(model)):
        kinds.setdefault(boundary, set()).add(fqn in experts)
    mixed = [b for b, k in kinds.items() if len(k) == 2]
    if mixed:
        raise SpecError(f"dmuon.hook_boundaries: '{mixed[0]}' holds MoE experts and other "
                        f"Muon params, which layout.ep = {ep} lays out apart; give the "
                        "experts' module a boundary of its own (or leave the setting out)")


def ep_ledger(moe: MoEShape, P: int, *, tokens: int, micros: int, elt: int,
              checkpointing: bool) -> dict[str, Fraction]:
    """``{phase: bytes}`` on the ``ep`` dim per step for one rank that runs ``micros``
    micro-batches of ``tokens`` tokens each."""
    if P == 1 or not moe.layers:
        return {}
    share = Fraction(P - 1, P)
    rows = tokens * moe.top_k * moe.hidden * elt
    forward = moe.layers * micros * share * (8 * moe.experts + 2 * rows)
    out = {"forward": forward, "backward": moe.layers * micros * share * 2 * rows}
    if checkpointing:
        out["recompute"] = forward
    return out
