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
from .routing import owner_adamw, resolve_policies, routed_predicate

# on an expert-parallel 3-D param (``dmuon.shard_experts``): (the layer's experts, EP
# degree, this rank's EP coordinate); the param holds experts [E/P * ep, E/P * (ep + 1))
EP_ATTR = "_dmuon_ep"
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
    ep: int | None = None  # expert parallelism: the EP coordinate whose ranks hold it
    route: str = "muon"  # or "adamw": stepped by AdamW on its owner (``dmuon.routing``)


@dataclass
class DedicationPlan(Mapping):
    """The result of the global LPT partition, identical on every rank. Once
    ``dedicate_params`` has bound it to the model, it is also a read-only mapping
    from each dedicated ``nn.Parameter`` to its owner's global rank (the reference's
    return value; a 3-D param sliced over several owners maps to the tuple of them)."""

    shard_size: int
    replicate_size: int
    params: dict[str, Assignment] = field(default_factory=dict)
    # under tensor parallelism: the T peers of each (replicate, shard) coordinate share
    # its matrices, each owner holding its TP shard; ``owner`` is the coordinate's index
    tp_size: int = 1
    # expert parallelism: shard index s has EP coordinate s % ep_size; an expert param's
    # slices are owned inside the expert shard group of the coordinate holding them
    ep_size: int = 1
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
            "ep_size": self.ep_size,
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
                    "ep": a.ep,
                    "route": a.route,
                }
                for a in self.params.values()
            },
        }

    @classmethod
    def from_dict(cls, stored: Mapping) -> DedicationPlan:
        """The plan ``to_dict`` wrote (a stored plan, read back from JSON)."""
        plan = cls(int(stored["shard_size"]), int(stored["replicate_size"]),
                   tp_size=int(stored.get("tp_size", 1)), ep_size=int(stored.get("ep_size", 1)))
        for unit, a in stored["params"].items():
            plan.params[unit] = Assignment(
                fqn=unit, shape=tuple(a["shape"]), boundary=a["boundary"],
                owner=int(a["owner"]), owner_coord=tuple(a["owner_coord"]),
                numel=int(a["numel"]), ns_flops=int(a["ns_flops"]), tp=a.get("tp"),
                param=a.get("param") or unit, ep=a.get("ep"), route=a.get("route", "muon"),
                experts=tuple(a["experts"]) if a.get("experts") else None)
        return plan

    def table(self) -> str:
        """Per-rank ownership table as printed by the demo and the CLI."""
        return _ownership_table(self)


def _ownership_table(plan: DedicationPlan) -> str:
    """Under TP one row per (r, s, t) rank (global rank ``(r * N + s) * T + t``), each
    holding 1/T of its coordinate's matrices."""
    per_rank, flops = plan.elements_per_rank, plan.ns_flops_per_rank
    counts = Counter(a.owner for a in plan.params.values())
    T, P = plan.tp_size, plan.ep_size
    coord, ep = "(r,s)" if T == 1 else "(r,s,t)", f" {'ep':>3}" if P > 1 else ""
    lines = [f"{'rank':>4} {coord:>7}{ep} {'matrices':>8} {'elements':>14} {'NS GFLOP':>10}"]
    for rank in range(plan.world_size * T):
        slot, t = divmod(rank, T)
        where = ",".join(map(str, divmod(slot, plan.shard_size) + ((t,) if T > 1 else ())))
        ep = f" {slot % plan.shard_size % P:>3}" if P > 1 else ""
        lines.append(
            f"{rank:>4} {'(' + where + ')':>7}{ep} {counts[slot]:>8} "
            f"{per_rank[slot] // T:>14,} {flops[slot] / T / 1e9:>10.2f}")
    lines.append(f"imbalance (max/mean): elements {plan.imbalance:.4f}, "
                 f"NS FLOPs {plan.ns_imbalance:.4f}")
    return "\n".join(lines)


def select_params(model: nn.Module, predicate, owner_adamw=frozenset()) -> list[tuple]:
    """The dedicated params in registration order. A non-matrix tensor the predicate
    selects (a norm caught by ``"proj" in n``) is left to AdamW with one warning naming
    them all, as the reference does, unless routed to its owner (``owner_adamw``)."""
    selected, left = [], []
    for name, param in model.named_parameters():
        if not predicate(name, param):
            continue
        if param.ndim in (2, 3) or name in owner_adamw:
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


def lpt_assign(items: list[tuple[str, int, int, str]], slots: int,
               allowed: dict[str, list[int]] | None = None) -> dict[str, int]:
    """Global longest-processing-time assignment of (name, NS FLOPs, elements, boundary)
    to slots, on both costs at once: NS FLOPs are the owner's compute, elements its
    memory and traffic. Largest first (by the two shares of the mean, summed), each item
    to the slot where the larger of its two loads relative to the mean grows least.
    Params of a boundary that fits on ``slots`` owners never share one, so a boundary's
    segments come from distinct owners. ``allowed``: the slots an item may go to (an
    expert slice: the ranks of its EP coordinate), all by default."""
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
        candidates = (allowed or {}).get(name, range(slots))
        if per_boundary[boundary] <= len(candidates):
            candidates = [s for s in candidates if s not in used[boundary]] or candidates

        def grown(s, f=f, e=e):
            a, b = (flops[s] + f) / mean_f, (elements[s] + e) / mean_e
            return max(a, b), a + b, s

        slot = min(candidates, key=grown)
        owner[name] = slot
        flops[slot] += f
        elements[slot] += e
        used[boundary].add(slot)
    return owner


def expert_units(fqn: str, shape, slots: int, first: int = 0,
                 count: int | None = None) -> list[tuple[str, tuple, tuple[int, int]]]:
    """Experts ``[first, first + count)`` of a 3-D (experts, out, in) param (all by
    default) as up to ``slots`` contiguous slices of experts."""
    count = int(shape[0]) if count is None else count
    chunks = min(count, slots)
    bounds = [first + count * i // chunks for i in range(chunks + 1)]
    return [(f"{fqn}[{lo}:{hi}]", (hi - lo, *shape[1:]), (lo, hi))
            for lo, hi in zip(bounds, bounds[1:])]


def ep_slots(shard_size: int, replicate_size: int, ep_size: int, ep: int) -> list[int]:
    """The slots of EP coordinate ``ep``: shard index ``s = j * ep_size + ep`` in every
    replica (the EP group is ``ep_size`` consecutive shard indices)."""
    return [r * shard_size + s for r in range(replicate_size)
            for s in range(ep, shard_size, ep_size)]


def plan_units(entries: list[tuple[str, tuple[int, ...], str]], slots: int,
               ep_params=(), ep_size: int = 1) -> list[tuple]:
    """(unit, shape, boundary, param fqn, experts, ep) in registration order: a 3-D param
    becomes its slices of experts, each a unit of the partition; an expert-parallel one
    (in ``ep_params``) its E/P experts per EP coordinate, sliced over that coordinate's
    ``slots / ep_size`` ranks."""
    units = []
    for fqn, shape, boundary in entries:
        if fqn in ep_params:
            per = int(shape[0]) // ep_size
            for ep in range(ep_size):
                units += [(u, s, boundary, fqn, r, ep) for u, s, r in
                          expert_units(fqn, shape, slots // ep_size, ep * per, per)]
        elif len(shape) == 3:
            units += [(u, s, boundary, fqn, r, None)
                      for u, s, r in expert_units(fqn, shape, slots)]
        else:
            units.append((fqn, tuple(shape), boundary, fqn, None, None))
    return units


def _owners_in_expert_order(units: list[tuple], owners: dict[str, int],
                            shard_size: int) -> None:
    """An expert-parallel param's slices of one EP coordinate take the owners LPT chose
    for them in expert order: by shard column, then replica. Each column's experts are
    then contiguous in the param, so its boundary gathers them straight into the
    param's own storage (no packed buffer beside it); the owners, and so the balance
    and the distinct owners of a boundary, stay as chosen."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for unit, _, _, fqn, _, ep in units:
        if ep is not None:
            groups[(fqn, ep)].append(unit)
    for slices in groups.values():
        chosen = sorted((owners[u] for u in slices),
                        key=lambda slot: (slot % shard_size, slot // shard_size))
        owners.update(zip(slices, chosen))


def check_ep(shape_of: dict[str, tuple], ep_params, shard_size: int, ep_size: int) -> None:
    """Refuse an EP degree that does not divide the shard group or an expert count."""
    if ep_size < 1 or shard_size % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the shard group's {shard_size} "
                         "ranks (the EP group lies inside it)")
    for fqn in ep_params:
        if int(shape_of[fqn][0]) % ep_size:
            raise ValueError(f"'{fqn}': its {shape_of[fqn][0]} experts do not divide "
                             f"over ep_size={ep_size}")


def plan_from_shapes(
    entries: list[tuple[str, tuple[int, ...], str]],
    shard_size: int,
    replicate_size: int = 1,
    ns_steps: int = 5,
    ep_params=(),
    ep_size: int = 1,
    owner_adamw=frozenset()) -> DedicationPlan:
    """Plan from (fqn, shape, boundary) triples in registration order (``ep_params``: the
    expert-parallel 3-D params, whole layer's shapes; ``owner_adamw``: no NS FLOPs)."""
    if shard_size < 1 or replicate_size < 1:
        raise ValueError(f"shard_size={shard_size}, replicate_size={replicate_size} must be >= 1")
    check_ep({e[0]: e[1] for e in entries}, ep_params, shard_size, ep_size)
    slots = shard_size * replicate_size
    units = plan_units(entries, slots, ep_params, ep_size)
    numels = {u[0]: _numel(u[1]) for u in units}
    flops = {u[0]: 0 if u[3] in owner_adamw else ns_flops(u[1], ns_steps) for u in units}
    allowed = {u[0]: ep_slots(shard_size, replicate_size, ep_size, u[5])
               for u in units if u[5] is not None}
    owners = lpt_assign([(u[0], flops[u[0]], numels[u[0]], u[2]) for u in units], slots,
                        allowed)
    _owners_in_expert_order(units, owners, shard_size)
    plan = DedicationPlan(shard_size, replicate_size, ep_size=ep_size)
    for unit, shape, boundary, fqn, experts, ep in units:
        slot = owners[unit]
        plan.params[unit] = Assignment(
            fqn=unit, shape=tuple(shape), boundary=boundary, owner=slot,
            owner_coord=(slot // shard_size, slot % shard_size), numel=numels[unit],
            ns_flops=flops[unit], param=fqn, experts=experts, ep=ep,
            route="adamw" if fqn in owner_adamw else "muon",
        )
    return plan


def whole_shape(p) -> tuple[int, ...]:
    """A param's shape; an expert-parallel one's with the whole layer's experts."""
    mark = getattr(p, EP_ATTR, None)
    return (mark[0], *p.shape[1:]) if mark else tuple(p.shape)


def model_entries(model: nn.Module, predicate, hook_boundary_predicate=None,
                  hook_boundary_strict: bool = True, owner_adamw=frozenset(),
                  allow_empty: bool = False) -> list[tuple]:
    """(fqn, shape, hook boundary) of each dedicated param, in registration order (an
    expert-parallel param with the whole layer's shape). None is an error (a predicate
    that matches nothing) unless ``allow_empty``: a pipeline stage may hold no matrix."""
    entries = [
        (name, whole_shape(p), resolve_boundary(model, name, hook_boundary_predicate,
                                                  hook_boundary_strict))
        for name, p in select_params(model, predicate, owner_adamw)
    ]
    if not entries and not allow_empty:
        raise ValueError("predicate selected no parameters for DMuon")
    return entries


def model_ep(model: nn.Module, predicate) -> tuple[frozenset, int]:
    """(the expert-parallel Muon-target params, their EP degree; 1 without)."""
    marks = {name: getattr(p, EP_ATTR) for name, p in model.named_parameters()
             if getattr(p, EP_ATTR, None) and predicate(name, p)}
    sizes = {m[1] for m in marks.values()}
    if len(sizes) > 1:
        raise ValueError(f"expert params sharded over different EP degrees {sorted(sizes)}")
    return frozenset(marks), sizes.pop() if sizes else 1


def partition(model: nn.Module, *, predicate, shard_size: int, replicate_size: int = 1,
              hook_boundary_predicate=None, hook_boundary_strict: bool = True, experts=None,
              ep_size: int = 1, param_policy=None) -> DedicationPlan:
    """The plan ``dedicate_params`` would make, without a process group (meta models).
    ``experts``/``ep_size``: what ``shard_experts`` would be given, for a model it has
    not cut (a planner's whole model); a model it has cut carries its own marks.
    ``param_policy``: as ``dedicate_params`` takes it (``dmuon.routing``): the params it
    routes to ``"sharded_adamw"`` are left out, those routed to ``"adamw"`` planned on
    an owner with no NS FLOPs."""
    policies = resolve_policies(model, predicate, param_policy)
    predicate, adamw = routed_predicate(predicate, policies), owner_adamw(policies)
    entries = model_entries(model, predicate, hook_boundary_predicate, hook_boundary_strict,
                            adamw)
    if experts is None or ep_size == 1:
        ep_params, ep_size = model_ep(model, predicate)
    else:
        ep_params = frozenset(n for n, p in model.named_parameters()
                              if p.ndim == 3 and predicate(n, p) and experts(n, p))
    return plan_from_shapes(entries, shard_size, replicate_size, ep_params=ep_params,
                            ep_size=ep_size, owner_adamw=adamw)


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
               replicate_size: int, ep_params=(), ep_size: int = 1) -> None:
    """Refuse, naming the first mismatch, a stored plan for another mesh or model."""
    if (plan.replicate_size, plan.shard_size) != (replicate_size, shard_size):
        raise PlanMismatch(
            f"the plan is for a {plan.replicate_size} x {plan.shard_size} (replicate x "
            f"shard) mesh; this one is {replicate_size} x {shard_size}")
    if plan.ep_size != ep_size:
        raise PlanMismatch(f"the plan is for EP {plan.ep_size}; this model's experts are "
                           f"sharded over EP {ep_size}")
    live = [(u, tuple(s), b) for u, s, b, *_ in
            plan_units(entries, plan.world_size, ep_params, ep_size)]
    stored = [(a.fqn, tuple(a.shape), a.boundary) for a in plan.params.values()]
    found = _first_difference(stored, live)
    if found is not None:
        raise PlanMismatch(f"the plan does not match the model: {found}")
    for a in plan.params.values():
        if not 0 <= a.owner < plan.world_size or \
                a.owner_coord != divmod(a.owner, plan.shard_size) or \
                (a.ep is not None and a.owner_coord[1] % ep_size != a.ep):
            raise PlanMismatch(f"'{a.fqn}': owner {a.owner} at {a.owner_coord} is not a "
                               f"rank of a {replicate_size} x {shard_size} mesh")


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())
