"""What a plan costs each rank: bytes per step by mesh dim and phase (as the ledger
counts them) and resident bytes by kind (as ``memory_report`` measures them), from the
plan alone, so a 70B layout can be costed on a laptop.

Per step, rank (r, s) of an R x N layout moves, with P the Muon-target elements:
- shard: all-gather (N-1)/N x P x param bytes in forward, again in backward under Z3,
  reduce-scatter (N-1)/N x P x reduce bytes (expert parallelism: the dense units over
  the N ranks, one coordinate's experts over its N/EP), and all-reduces of 2(N-1)/N x 4 bytes per
  flag: one per unit (which units got a gradient anywhere), one per rank and one more
  (which ranks' gradients were not finite), then after NS one (an update not finite);
- replicate (R > 1): reduce-scatter (R-1)/R x C_s x reduce bytes and, after the step,
  all-gather (R-1)/R x C_s x param bytes, C_s the elements of its shard column; the
  same all-reduce of flags.
"""

from __future__ import annotations

from fractions import Fraction

from .partition import DedicationPlan

PRESENCE_BYTES = 4  # one fp32 flag


def presence_flags(plan: DedicationPlan) -> int:
    """Flags the step all-reduces: per unit, per rank and FSDP2's before the landing,
    and one after NS (``Muon._check_updates``)."""
    return len(plan.params) + plan.world_size + 1 + 1


def exact(value: Fraction) -> int | float:
    return int(value) if value.denominator == 1 else float(value)


def column_elements(plan: DedicationPlan) -> list[int]:
    out = [0] * plan.shard_size
    for a in plan.params.values():
        out[a.owner_coord[1]] += a.numel
    return out


def gathered_elements(plan: DedicationPlan) -> tuple[int, int]:
    """(the dense units' elements, one EP coordinate's expert units' elements): what a
    rank gathers over its shard group and over its expert shard group (every coordinate
    holds E/P experts of each layer, so the same count)."""
    dense = sum(a.numel for a in plan.params.values() if a.ep is None)
    experts = sum(a.numel for a in plan.params.values() if a.ep is not None)
    return dense, experts // plan.ep_size


def ledger_prediction(plan: DedicationPlan, rank: int, *, z3: bool, param_bytes: int,
                      reduce_bytes: int) -> dict[str, dict[str, int | float]]:
    """``{dim: {phase: bytes}}`` of one training step on ``rank`` (the ``ep`` dim's
    token all-to-alls depend on the model and its routing, not the plan: not here)."""
    n, r = plan.shard_size, plan.replicate_size
    flags, m = presence_flags(plan), n // plan.ep_size
    dense, experts = gathered_elements(plan)
    share = Fraction(n - 1, n)
    moved = share * dense + Fraction(m - 1, m) * experts  # expert shard group: m ranks
    shard = {"forward": moved * param_bytes, "reduce": moved * reduce_bytes,
             "step": 2 * share * flags * PRESENCE_BYTES}
    if z3:
        shard["backward"] = shard["forward"]
    out = {"shard": {k: exact(v) for k, v in shard.items()}}
    column = column_elements(plan)[rank % n]
    if r > 1:
        share = Fraction(r - 1, r)
        repl = {"step": 2 * share * flags * PRESENCE_BYTES}
        if column:
            repl.update(reduce=share * column * reduce_bytes,
                        replicate=share * column * param_bytes)
        out["replicate"] = {k: exact(v) for k, v in repl.items()}
    return out


def boundary_elements(plan: DedicationPlan) -> list[int]:
    """Elements of each hook boundary on a rank, in forward order (an expert-parallel
    boundary's: one EP coordinate's)."""
    return [sum(plan.params[u].numel for u in units)
            // (plan.ep_size if plan.params[units[0]].ep is not None else 1)
            for units in plan.boundaries.values()]


def packed_peak_bytes(plan: DedicationPlan, *, z3: bool, prefetch: int,
                      param_bytes: int) -> int:
    """Largest packed-buffer bytes alive at once: Z2 keeps every boundary; Z3 the running
    boundary and the ``prefetch`` after it."""
    sizes = boundary_elements(plan)
    if not z3:
        return sum(sizes) * param_bytes
    window = prefetch + 1
    return max(sum(sizes[i:i + window]) for i in range(len(sizes))) * param_bytes


def memory_prediction(plan: DedicationPlan, rank: int, *, z3: bool, param_bytes: int,
                      master_bytes: int, row_moments: bool = False) -> dict[str, int]:
    """DMuon's resident bytes on ``rank`` after a step (kinds of ``memory_report``).
    ``row_moments``: NorMuon's, which keeps one second moment per row of every matrix it
    owns (``dmuon.normuon.second_moment_like``) next to the momentum."""
    owned = plan.elements_per_rank[rank]
    column = column_elements(plan)[rank % plan.shard_size]
    masters_apart = owned * master_bytes if master_bytes != param_bytes else 0
    rows = sum(a.numel // a.shape[-1] for a in plan.params.values()
               if a.owner == rank) if row_moments else 0
    return {"packed_buffers": 0 if z3 else sum(gathered_elements(plan)) * param_bytes,
            "owned_params": column * param_bytes + masters_apart,
            "momentum": (owned + rows) * master_bytes}
