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
    return _column(plan, lambda a: a.numel)


def _column(plan: DedicationPlan, size) -> list[int]:
    out = [0] * plan.shard_size
    for a in plan.params.values():
        out[a.owner_coord[1]] += size(a)
    return out


def _gathered(plan: DedicationPlan, size) -> tuple[int, int]:
    dense = sum(size(a) for a in plan.params.values() if a.ep is None)
    experts = sum(size(a) for a in plan.params.values() if a.ep is not None)
    return dense, experts // plan.ep_size


def gathered_elements(plan: DedicationPlan) -> tuple[int, int]:
    """(the dense units' elements, one EP coordinate's expert units' elements): what a
    rank gathers over its shard group and over its expert shard group (every coordinate
    holds E/P experts of each layer, so the same count)."""
    return _gathered(plan, lambda a: a.numel)


def _sizer(param_bytes: int, reduce_bytes: int, boundary_bytes) -> tuple:
    """(a unit's param bytes, its reduce bytes): its hook boundary's own where
    ``boundary_bytes`` gives them (``{boundary: (param bytes, reduce bytes)}``, a
    ``param_policy``'s ``param_dtype``/``grad_dtype``: one packed buffer, one reduce per
    boundary), else the defaults."""
    own = boundary_bytes or {}
    return (lambda a: a.numel * own.get(a.boundary, (param_bytes, reduce_bytes))[0],
            lambda a: a.numel * own.get(a.boundary, (param_bytes, reduce_bytes))[1])


def ledger_prediction(plan: DedicationPlan, rank: int, *, z3: bool, param_bytes: int,
                      reduce_bytes: int, boundary_bytes=None) -> dict[str, dict[str, int | float]]:
    """``{dim: {phase: bytes}}`` of one training step on ``rank`` (the ``ep`` dim's
    token all-to-alls depend on the model and its routing, not the plan: not here).
    ``boundary_bytes``: the boundaries with bytes of their own (``_sizer``)."""
    n, r = plan.shard_size, plan.replicate_size
    flags, m = presence_flags(plan), n // plan.ep_size
    share = Fraction(n - 1, n)
    sizes = _sizer(param_bytes, reduce_bytes, boundary_bytes)
    # expert shard group: m ranks
    moved = [share * dense + Fraction(m - 1, m) * experts
             for dense, experts in (_gathered(plan, size) for size in sizes)]
    shard = {"forward": moved[0], "reduce": moved[1],
             "step": 2 * share * flags * PRESENCE_BYTES}
    if z3:
        shard["backward"] = shard["forward"]
    out = {"shard": {k: exact(v) for k, v in shard.items()}}
    column = [_column(plan, size)[rank % n] for size in sizes]
    if r > 1:
        share = Fraction(r - 1, r)
        repl = {"step": 2 * share * flags * PRESENCE_BYTES}
        if column[0]:
            repl.update(reduce=share * column[1], replicate=share * column[0])
        out["replicate"] = {k: exact(v) for k, v in repl.items()}
    return out


def boundary_elements(plan: DedicationPlan) -> list[int]:
    """Elements of each hook boundary on a rank, in forward order (an expert-parallel
    boundary's: one EP coordinate's)."""
    return [sum(plan.params[u].numel for u in units)
            // (plan.ep_size if plan.params[units[0]].ep is not None else 1)
            for units in plan.boundaries.values()]


def packed_peak_bytes(plan: DedicationPlan, *, z3: bool, prefetch: int,
                      param_bytes: int, boundary_bytes=None) -> int:
    """Largest packed-buffer bytes alive at once: Z2 keeps every boundary; Z3 the running
    boundary and the ``prefetch`` after it."""
    own = boundary_bytes or {}
    sizes = [n * own.get(name, (param_bytes,))[0]
             for name, n in zip(plan.boundaries, boundary_elements(plan))]
    if not z3:
        return sum(sizes)
    window = prefetch + 1
    return max(sum(sizes[i:i + window]) for i in range(len(sizes)))


def memory_prediction(plan: DedicationPlan, rank: int, *, z3: bool, param_bytes: int,
                      master_bytes: int, row_moments: bool = False,
                      boundary_bytes=None) -> dict[str, int]:
    """DMuon's resident bytes on ``rank`` after a step (kinds of ``memory_report``).
    ``row_moments``: NorMuon's, which keeps one second moment per row of every matrix it
    owns (``dmuon.normuon.second_moment_like``) next to the momentum. A boundary whose
    params' dtype is the master's keeps no master apart."""
    mine = [a for a in plan.params.values() if a.owner == rank]  # one pass over the units
    owned = sum(a.numel for a in mine)
    param_size = _sizer(param_bytes, 0, boundary_bytes)[0]
    column = _column(plan, param_size)[rank % plan.shard_size]
    masters_apart = sum(a.numel * master_bytes for a in mine
                        if param_size(a) != a.numel * master_bytes)
    rows = sum(a.numel // a.shape[-1] for a in mine) if row_moments else 0
    return {"packed_buffers": 0 if z3 else sum(_gathered(plan, param_size)),
            "owned_params": column + masters_apart,
            "momentum": (owned + rows) * master_bytes}
