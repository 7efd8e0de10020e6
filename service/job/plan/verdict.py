"""The planner's verdict on a layout: whether one rank's peak fits its device, and when
it does not, the smallest layout on nodes of the same kind that does (more nodes, or a
tensor-parallel degree that divides a node's GPUs), or that none does."""

from __future__ import annotations

from typing import Callable

from ..spec import JobSpec, SpecError
from .inventory import synthetic_inventory
from .layout_choice import PlacementError
from .modes import GB, HEADROOM
from .predict import MetaModel, Placement, needed_bytes, predict

MAX_NODES = 256  # the search's last node count


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def node_counts(start: int, limit: int = MAX_NODES) -> list[int]:
    """``start``, then every count up to 2 x ``start``, then steps of an eighth: each
    count at most 12.5% above the last, so the one found is close to the smallest."""
    out, n = [], max(1, start)
    while n <= max(limit, start):
        out.append(n)
        n += max(1, n // 8) if n >= 2 * start else 1
    return out


def tp_degrees(gpus_per_node: int, asked) -> list:
    """The TP degrees weighed: ``auto`` as asked (the planner chooses per node count),
    else every degree dividing a node's GPUs."""
    if asked == "auto":
        return ["auto"]
    return [t for t in range(1, gpus_per_node + 1) if gpus_per_node % t == 0]


def _gb(n: float) -> str:
    """Bytes in GB, or in MB where that would read 0.0 GB."""
    return f"{n / GB:.1f} GB" if n >= 0.1 * GB else f"{n / 1e6:.1f} MB"


def peak_words(p: Placement) -> str:
    m = p.modes
    return (f"peak {_gb(needed_bytes(m))} of {m.device_bytes / GB:.0f} GB per rank "
            f"({m.dmuon.upper()}; at most {_gb(HEADROOM * m.device_bytes)} usable)")


def layout_words(p: Placement, gpus_per_node: int) -> str:
    n = p.layout.nodes
    return (f"{n} node{'s' if n != 1 else ''} x {_gpus(gpus_per_node)} with "
            f"--tp {p.layout.tp} (layout {p.layout.shown()}, {p.modes.dmuon.upper()}, peak "
            f"{_gb(needed_bytes(p.modes))})")


def _try(spec: JobSpec, nodes: int, gpus_per_node: int, meta: MetaModel,
         bandwidth: dict) -> Placement | None:
    try:
        return predict(spec, synthetic_inventory(nodes, gpus_per_node),
                       bandwidth=bandwidth, model_source=meta)
    except (PlacementError, SpecError):  # a degree the model or the batch refuses
        return None


def smallest_fit(spec_for: Callable[[object], JobSpec], start: int, gpus_per_node: int,
                 asked_tp, meta: MetaModel, bandwidth: dict) -> Placement | None:
    """The fewest nodes (then the smallest TP degree) whose ranks fit, from ``start``
    nodes up to ``MAX_NODES``; None when even the most nodes fit no degree."""
    degrees = tp_degrees(gpus_per_node, asked_tp)
    counts = node_counts(start)

    def fits(n: int, t) -> Placement | None:
        p = _try(spec_for(t), n, gpus_per_node, meta, bandwidth)
        return p if p is not None and p.modes.fits else None

    for i, n in enumerate(counts):
        # past twice the nodes asked: stop where even the most nodes do not fit
        if n > 2 * start and counts[i - 1] <= 2 * start \
                and not any(fits(counts[-1], t) for t in degrees):
            return None
        for t in degrees:
            found = fits(n, t)
            if found is not None:
                return found
    return None


def verdict(placement: Placement, spec_for, gpus_per_node: int, asked_tp, meta: MetaModel,
            bandwidth: dict) -> tuple[str, bool]:
    """(the verdict line, whether the layout asked for fits)."""
    if placement.modes.fits:
        return f"fits: {peak_words(placement)}", True
    found = smallest_fit(spec_for, placement.layout.nodes, gpus_per_node, asked_tp, meta,
                         bandwidth)
    if found is None:
        degrees = ", ".join(map(str, tp_degrees(gpus_per_node, asked_tp)))
        tail = (f"no layout fits on up to {MAX_NODES} nodes x {_gpus(gpus_per_node)} "
                f"(--tp {degrees}); try --activation-checkpointing, a smaller --batch-size "
                "or --seq-len")
    else:
        tail = f"the smallest layout that fits is {layout_words(found, gpus_per_node)}"
    return f"does not fit: {peak_words(placement)}; {tail}", False
