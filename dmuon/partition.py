"""Owner assignment: which rank owns each Muon-target matrix.

Pure functions over names and shapes, so a 70B model on the meta device can be planned
on a laptop. Owners are *slots*: ``slot = replicate_index * shard_size + shard_index``,
which is the global rank on a row-major (replicate, shard) mesh.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .newton_schulz import ns_flops

_LAYER_FQN = re.compile(r"(?:^|\.)(?:layers|blocks)\.\d+(?=\.)")


@dataclass(frozen=True)
class Assignment:
    """One Muon-target parameter and its owner."""

    fqn: str  # the unit: a parameter's FQN, or "<fqn>[lo:hi]" for a slice of experts
    shape: tuple[int, ...]
    boundary: str
    owner: int
    owner_coord: tuple[int, int]  # (replicate, shard)
    numel: int
    ns_flops: int
    tp: str | None = None  # under tensor parallelism: "gram_allreduce" or "gather"
    param: str = ""  # the parameter's FQN (== fqn unless this is a slice of experts)
    experts: tuple[int, int] | None = None  # [lo, hi) of a 3-D (experts, out, in) param


@dataclass
class DedicationPlan(Mapping):
    """The result of the global LPT partition, identical on every rank.

    Once ``dedicate_params`` has bound it to the model, it is also a read-only mapping
    from each dedicated ``nn.Parameter`` to its owner's global rank (the reference's
    return value; a 3-D param sliced over several owners maps to the tuple of them)."""

    shard_size: int
    replicate_size: int
    params: dict[str, Assignment] = field(default_factory=dict)
    # under tensor parallelism: the T peers of each (replicate, shard) coordinate share
    # its matrices, each owner holding its TP shard; ``owner`` is the coordinate's index
    tp_size: int = 1
    _bound: dict = field(default_factory=dict, repr=False, compare=False)

    def bind(self, params: dict[str, nn.Parameter]) -> None:
        """``params``: the model's params by FQN."""
        self._bound = {id(params[fqn]): (params[fqn], fqn) for fqn in self.param_fqns}

    def __getstate__(self):  # pickles and copies carry the plan, not the model's params
        return {**self.__dict__, "_bound": {}}

    def __getitem__(self, param) -> int | tuple[int, ...]:
        bound = self._bound.get(id(param))
        if bound is None or bound[0] is not param:
            raise KeyError("not a dedicated param of this plan's model")
        owners = sorted({self.params[u].owner for u in self.param_fqns[bound[1]]})
        return owners[0] if len(owners) == 1 else tuple(owners)

    def __iter__(self):
        return (p for p, _ in self._bound.values())

    def __len__(self) -> int:
        return len(self._bound)

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    def _per_rank(self, attr: str) -> list[int]:
        out = [0] * self.world_size
        for a in self.params.values():
            out[a.owner] += getattr(a, attr)
        return out

    @property
    def elements_per_rank(self) -> list[int]:
        return self._per_rank("numel")

    @property
    def ns_flops_per_rank(self) -> list[int]:
        return self._per_rank("ns_flops")

    @property
    def total_elements(self) -> int:
        return sum(a.numel for a in self.params.values())

    @staticmethod
    def _max_over_mean(per_rank: list[int]) -> float:
        mean = sum(per_rank) / len(per_rank)
        return max(per_rank) / mean if mean else 1.0

    @property
    def imbalance(self) -> float:
        """Largest rank's elements over the mean (1.0 is perfect balance)."""
        return self._max_over_mean(self.elements_per_rank)

    @property
    def ns_imbalance(self) -> float:
        """Largest rank's NS FLOPs over the mean."""
        return self._max_over_mean(self.ns_flops_per_rank)

    def _units_by(self, field: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for a in self.params.values():
            out.setdefault(getattr(a, field), []).append(a.fqn)
        return out

    @property
    def boundaries(self) -> dict[str, list[str]]:
        """Hook boundary -> its units, in plan order."""
        return self._units_by("boundary")

    @property
    def param_fqns(self) -> dict[str, list[str]]:
        """Parameter FQN -> its units (one, or its expert slices in order)."""
        return self._units_by("param")

    def owner_of(self, fqn: str) -> int:
        return self.params[fqn].owner

    def owned_by(self, rank: int) -> list[str]:
        return [a.fqn for a in self.params.values() if a.owner == rank]

    def to_dict(self) -> dict:
        return {
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "tp_size": self.tp_size,
            "imbalance": self.imbalance,
            "ns_imbalance": self.ns_imbalance,
            "elements_per_rank": self.elements_per_rank,
            "ns_flops_per_rank": self.ns_flops_per_rank,
            "params": {
                a.fqn: {
                    "owner": a.owner,
                    "owner_coord": list(a.owner_coord),
                    "shape": list(a.shape),
                    "numel": a.numel,
                    "ns_flops": a.ns_flops,
                    "boundary": a.boundary,
                    "tp": a.tp,
                    "param": a.param,
                    "experts": list(a.experts) if a.experts else None,
                }
                for a in self.params.values()
            },
        }

    @classmethod
    def from_dict(cls, stored: Mapping) -> DedicationPlan:
        """The plan ``to_dict`` wrote (a stored plan, read back from JSON)."""
        plan = cls(int(stored["shard_size"]), int(stored["replicate_size"]),
                   tp_size=int(stored.get("tp_size", 1)))
        for unit, a in stored["params"].items():
            experts = a.get("experts")
            plan.params[unit] = Assignment(
                fqn=unit, shape=tuple(a["shape"]), boundary=a["boundary"],
                owner=int(a["owner"]), owner_coord=tuple(a["owner_coord"]),
                numel=int(a["numel"]), ns_flops=int(a["ns_flops"]), tp=a.get("tp"),
                param=a.get("param") or unit, experts=tuple(experts) if experts else None)
        return plan

    def table(self) -> str:
        """Per-rank ownership table as printed by the demo and the CLI. Under tensor
        parallelism one row per (r, s, t) rank (global rank ``(r * N + s) * T + t``, the
        ``(replicate, shard, tp)`` mesh), each holding 1/T of its coordinate's matrices."""
        per_rank, flops = self.elements_per_rank, self.ns_flops_per_rank
        counts = Counter(a.owner for a in self.params.values())
        T = self.tp_size
        coord = "(r,s,t)" if T > 1 else "(r,s)"
        lines = [f"{'rank':>4} {coord:>7} {'matrices':>8} {'elements':>14} {'NS GFLOP':>10}"]
        for rank in range(self.world_size * T):
            slot, t = divmod(rank, T)
            where = f"{slot // self.shard_size},{slot % self.shard_size}" + (f",{t}" if T > 1
                                                                           else "")
            lines.append(
                f"{rank:>4} {'(' + where + ')':>7} {counts[slot]:>8} "
                f"{per_rank[slot] // T:>14,} {flops[slot] / T / 1e9:>10.2f}")
        lines.append(f"imbalance (max/mean): elements {self.imbalance:.4f}, "
                     f"NS FLOPs {self.ns_imbalance:.4f}")
        return "\n".join(lines)


def select_params(model: nn.Module, predicate) -> list[tuple[str, nn.Parameter]]:
    """The Muon-target params in registration order. A non-matrix tensor the predicate
    selects (a bias or a norm caught by ``"proj" in n``) is left to AdamW, as the
    reference does, with one warning that names every such param."""
    selected, left = [], []
    for name, param in model.named_parameters():
        if not predicate(name, param):
            continue
        if param.ndim in (2, 3):
            selected.append((name, param))
        else:
            left.append(f"'{name}' {tuple(param.shape)}")
    if left:
        warnings.warn(
            f"predicate selected {len(left)} non-matrix params, which go to AdamW (DMuon "
            f"orthogonalises 2-D matrices and 3-D (experts, out, in) stacks only): "
            f"{', '.join(left)}", UserWarning, stacklevel=4)
    return selected


def _ancestors(fqn: str):
    parts = fqn.split(".")[:-1]
    for i in range(len(parts), 0, -1):
        yield ".".join(parts[:i])


def resolve_boundary(model: nn.Module, fqn: str, hook_boundary_predicate, strict: bool) -> str:
    """FQN of the module whose hooks broadcast and reduce ``fqn``.

    With a predicate, the lowest ancestor it accepts; otherwise the deepest
    ``layers.N`` / ``blocks.N`` ancestor named in the FQN.
    """
    if hook_boundary_predicate is not None:
        for prefix in _ancestors(fqn):
            if hook_boundary_predicate(model.get_submodule(prefix)):
                return prefix
    else:
        matches = list(_LAYER_FQN.finditer(fqn))
        if matches:
            return fqn[: matches[-1].end()].lstrip(".")
    if strict:
        how = "hook_boundary_predicate" if hook_boundary_predicate else "'layers.N'/'blocks.N'"
        raise ValueError(
            f"dedicated param '{fqn}' has no hook boundary ({how} matched no ancestor); "
            "pass hook_boundary_predicate, exclude it from the predicate, or set "
            "hook_boundary_strict=False to hook its own module"
        )
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def lpt_assign(items: list[tuple[str, int, int, str]], slots: int) -> dict[str, int]:
    """Global longest-processing-time assignment of (name, NS FLOPs, elements, boundary)
    to slots, on both costs at once: NS FLOPs are the owner's compute, elements its
    memory and traffic. Largest first (by the two shares of the mean, summed), each item
    to the slot where the larger of its two loads relative to the mean grows least.
    Params of a boundary that fits on ``slots`` owners never share one, so a boundary's
    segments come from distinct owners."""
    per_boundary = Counter(b for *_, b in items)
    mean_f = max(sum(i[1] for i in items) / slots, 1)
    mean_e = max(sum(i[2] for i in items) / slots, 1)
    order = sorted(range(len(items)),
                   key=lambda i: (-(items[i][1] / mean_f + items[i][2] / mean_e), i))
    flops, elements = [0] * slots, [0] * slots
    used: dict[str, set[int]] = defaultdict(set)
    owner: dict[str, int] = {}
    for i in order:
        name, f, e, boundary = items[i]
        candidates = range(slots)
        if per_boundary[boundary] <= slots:
            candidates = [s for s in candidates if s not in used[boundary]]

        def grown(s, f=f, e=e):
            a, b = (flops[s] + f) / mean_f, (elements[s] + e) / mean_e
            return max(a, b), a + b, s

        slot = min(candidates, key=grown)
        owner[name] = slot
        flops[slot] += f
        elements[slot] += e
        used[boundary].add(slot)
    return owner


def expert_units(fqn: str, shape, slots: int) -> list[tuple[str, tuple, tuple[int, int]]]:
    """A 3-D (experts, out, in) param as up to ``slots`` contiguous slices of experts."""
    experts = int(shape[0])
    chunks = min(experts, slots)
    bounds = [experts * i // chunks for i in range(chunks + 1)]
    return [(f"{fqn}[{lo}:{hi}]", (hi - lo, *shape[1:]), (lo, hi))
            for lo, hi in zip(bounds, bounds[1:])]


def plan_units(entries: list[tuple[str, tuple[int, ...], str]], slots: int) -> list[tuple]:
    """(unit, shape, boundary, param fqn, experts) in registration order: a 3-D param
    becomes its slices of experts, each a unit of the partition."""
    units = []
    for fqn, shape, boundary in entries:
        if len(shape) == 3:
            units += [(u, s, boundary, fqn, r) for u, s, r in expert_units(fqn, shape, slots)]
        else:
            units.append((fqn, tuple(shape), boundary, fqn, None))
    return units


def plan_from_shapes(
    entries: list[tuple[str, tuple[int, ...], str]],
    shard_size: int,
    replicate_size: int = 1,
    ns_steps: int = 5,
) -> DedicationPlan:
    """Plan from (fqn, shape, boundary) triples in registration order."""
    if shard_size < 1 or replicate_size < 1:
        raise ValueError(f"shard_size={shard_size}, replicate_size={replicate_size} must be >= 1")
    slots = shard_size * replicate_size
    units = plan_units(entries, slots)
    numels = {u[0]: _numel(u[1]) for u in units}
    flops = {u[0]: ns_flops(u[1], ns_steps) for u in units}
    owners = lpt_assign([(u[0], flops[u[0]], numels[u[0]], u[2]) for u in units], slots)
    plan = DedicationPlan(shard_size, replicate_size)
    for unit, shape, boundary, fqn, experts in units:
        slot = owners[unit]
        plan.params[unit] = Assignment(
            fqn=unit, shape=tuple(shape), boundary=boundary, owner=slot,
            owner_coord=(slot // shard_size, slot % shard_size), numel=numels[unit],
            ns_flops=flops[unit], param=fqn, experts=experts,
        )
    return plan


def model_entries(model: nn.Module, predicate, hook_boundary_predicate=None,
                  hook_boundary_strict: bool = True) -> list[tuple[str, tuple, str]]:
    """(fqn, shape, hook boundary) of each Muon-target param, in registration order."""
    entries = [
        (name, tuple(p.shape), resolve_boundary(model, name, hook_boundary_predicate,
                                                 hook_boundary_strict))
        for name, p in select_params(model, predicate)
    ]
    if not entries:
        raise ValueError("predicate selected no parameters for DMuon")
    return entries


def partition(
    model: nn.Module,
    *,
    predicate,
    shard_size: int,
    replicate_size: int = 1,
    hook_boundary_predicate=None,
    hook_boundary_strict: bool = True,
) -> DedicationPlan:
    """The plan ``dedicate_params`` would make, without a process group (meta models)."""
    entries = model_entries(model, predicate, hook_boundary_predicate, hook_boundary_strict)
    return plan_from_shapes(entries, shard_size, replicate_size)


class PlanMismatch(ValueError):
    """A stored plan that does not describe the model or the mesh it is applied to."""


def _first_difference(stored: list[tuple], live: list[tuple]) -> str | None:
    """The first unit, in registration order, where the plan's (unit, shape, boundary)
    list and the model's differ, described; None when they agree."""
    names = {"plan": {u[0] for u in stored}, "model": {u[0] for u in live}}
    for i in range(max(len(stored), len(live))):
        s = stored[i] if i < len(stored) else None
        m = live[i] if i < len(live) else None
        if s == m:
            continue
        if s is not None and (m is None or s[0] not in names["model"]):
            here = f" (the model has '{m[0]}' there)" if m is not None else ""
            return f"'{s[0]}' is in the plan but is no Muon-target param of this model{here}"
        if s is None or m[0] not in names["plan"]:
            return f"'{m[0]}' is a Muon-target param of this model the plan does not list"
        if s[0] != m[0]:
            return f"'{m[0]}' comes at another position in the plan"
        what, k = ("shape", 1) if s[1] != m[1] else ("hook boundary", 2)
        return f"'{m[0]}': the plan's {what} is {s[k]!r}, this model's {m[k]!r}"
    return None


def check_plan(plan: DedicationPlan, entries: list[tuple], shard_size: int,
               replicate_size: int) -> None:
    """Refuse, naming the first mismatch, a stored plan for another mesh or model."""
    if (plan.replicate_size, plan.shard_size) != (replicate_size, shard_size):
        raise PlanMismatch(
            f"the plan is for a {plan.replicate_size} x {plan.shard_size} (replicate x "
            f"shard) mesh; this one is {replicate_size} x {shard_size}")
    live = [(u, tuple(s), b) for u, s, b, *_ in plan_units(entries, plan.world_size)]
    stored = [(a.fqn, tuple(a.shape), a.boundary) for a in plan.params.values()]
    found = _first_difference(stored, live)
    if found is not None:
        raise PlanMismatch(f"the plan does not match the model: {found}")
    for a in plan.params.values():
        if not 0 <= a.owner < plan.world_size or \
                a.owner_coord != divmod(a.owner, plan.shard_size):
            raise PlanMismatch(f"'{a.fqn}': owner {a.owner} at {a.owner_coord} is not a "
                               f"rank of a {replicate_size} x {shard_size} mesh")


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())
