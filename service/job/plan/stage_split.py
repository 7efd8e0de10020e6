"""Pipeline parallelism's plan (``layout.pp``): the model's layers split into contiguous
stages, and per pipeline rank its stages, its time, its memory and its ``pp`` bytes.

The split: the embedding on the first stage, the final norm and the head on the last,
the layers between in order; it minimises the slowest stage's cost, that stage's
forward and backward over the step's micro-batches PLUS its optimizer step, the
Newton-Schulz FLOPs at its owners (its Muon matrices are owned over the stage's R x N
data-parallel ranks, each matrix by one: a balanced share of the stage's NS FLOPs, at
least its largest matrix; under TP each of the T ranks takes 1/T). Time is FLOPs at
``FLOPS`` per GPU, for the matmuls and NS alike, so which split wins does not depend on
it. The split by layer count alone (``count_split``) and the one that leaves the step
out (``Costs(..., with_ns=False)``) are kept beside it for comparison.

Per layer, forward FLOPs per token: 2 x the elements of its 2-D weights, 2 x an
expert weight's x top_k / E, and 2 x seq x the attention width (causal: half of QK^T
and AV); backward is twice forward, per-block checkpointing adds a forward. The head's
forward is 2 x its weight per token, never recomputed; the embedding's is a lookup (0).

Bubble (the schedule's idle share): 1F1B and GPipe (pp-1)/(m+pp-1), interleaved 1F1B
with v stages per rank (pp-1)/(v m+pp-1). Micro-batches in flight on pp rank k: 1F1B
min(m, pp-k), GPipe m, interleaved min(v m, (v-1) pp + 2 (pp-k-1) + 1) stage-chunks.
``pp`` bytes: per stage boundary, each rank sends m x rows x seq x dim activations
forward (a sequence-parallel shard, 1/T, under TP) and their gradients back, on the
link between the two ranks' hosts (pp is outermost, so stages lie on separate hosts
once R x N x T fills one).

Torch-free arithmetic over ``Unit``s; ``model_units`` reads them off the meta model."""

from __future__ import annotations

import dataclasses
import itertools

FLOPS = 400e12  # sustained bf16 FLOP/s per GPU the times assume (H100 class, ~40% MFU)
KINDS = ("owned_params", "momentum", "gradients", "fsdp_shards", "adamw_state",
         "packed_buffers", "gathered_others", "activations")


@dataclasses.dataclass(frozen=True)
class Unit:
    """A layer, or the embedding or the head, as the split sees it (elements and FLOPs
    of the whole model's shapes, before TP)."""

    fwd_flops: float  # forward FLOPs per token
    ns_flops: int  # Newton-Schulz FLOPs of its Muon matrices, one step
    ns_largest: int  # the largest of one matrix's
    muon: int  # Muon elements
    others: int  # AdamW elements
    window: int = 0  # elements of its Z3 packed window unit (an EP coordinate's experts)


def bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """The pipeline's idle share of a step."""
    if schedule == "interleaved":
        return (pp - 1) / (v * m + pp - 1)
    return (pp - 1) / (m + pp - 1)


def in_flight(schedule: str, pp: int, m: int, k: int, v: int = 1) -> int:
    """Stage-chunks of micro-batches whose activations pp rank ``k`` holds at once."""
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(v * m, (v - 1) * pp + 2 * (pp - k - 1) + 1)
    return min(m, pp - k)


def count_split(layers: int, stages: int) -> list[tuple[int, int]]:
    """Layers ``[lo, hi)`` per stage by count alone: equal, the first ones one more."""
    size, extra = divmod(layers, stages)
    bounds = list(itertools.accumulate([size + (i < extra) for i in range(stages)],
                                       initial=0))
    return list(zip(bounds, bounds[1:]))


class Costs:
    """Seconds of a stage of layers ``[lo, hi)`` (with the embedding when ``lo`` is 0 and
    the head when ``hi`` is the last), for one pipeline rank's share of a step."""

    def __init__(self, embed: Unit, layers: list[Unit], head: Unit, *, tokens: int,
                 owners: int, tp: int = 1, checkpointed: bool = False,
                 with_ns: bool = True, flops: float = FLOPS):
        self.embed, self.layers, self.head = embed, layers, head
        passes = 4 if checkpointed else 3
        self.compute = tokens * passes / tp / flops  # seconds per forward FLOP per token
        self.head_compute = tokens * 3 / tp / flops
        self.owners, self.tp, self.flops, self.with_ns = owners, tp, flops, with_ns
        self._fwd = list(itertools.accumulate((u.fwd_flops for u in layers), initial=0))
        self._ns = list(itertools.accumulate((u.ns_flops for u in layers), initial=0))

    def fwd_bwd(self, lo: int, hi: int) -> float:
        last = hi == len(self.layers)
        return ((self._fwd[hi] - self._fwd[lo]) * self.compute
                + (self.head.fwd_flops * self.head_compute if last else 0.0)
                + (self.embed.fwd_flops * self.head_compute if lo == 0 else 0.0))

    def ns_at_owner(self, lo: int, hi: int) -> float:
        """NS FLOPs at the stage's busiest owner: a balanced share, at least its largest
        matrix; 1/T of it under TP."""
        total = self._ns[hi] - self._ns[lo]
        largest = max((u.ns_largest for u in self.layers[lo:hi]), default=0)
        return max(total / self.owners, largest) / self.tp

    def ns(self, lo: int, hi: int) -> float:
        return self.ns_at_owner(lo, hi) / self.flops

    def __call__(self, lo: int, hi: int) -> float:
        return self.fwd_bwd(lo, hi) + (self.ns(lo, hi) if self.with_ns else 0.0)


def best_split(costs: Costs, stages: int) -> list[tuple[int, int]]:
    """The contiguous split of the layers into ``stages`` (each at least one layer)
    whose slowest stage costs least: dynamic programming over the last cut."""
    n = len(costs.layers)
    if not 1 <= stages <= n:
        raise ValueError(f"layout.pp: {stages} stages for {n} layers (a stage holds one at "
                         "least)")
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for hi in range(j, n - (stages - j) + 1):
            for lo in range(j - 1, hi):
                worst = max(best[j - 1][lo], costs(lo, hi))
                if worst < best[j][hi]:
                    best[j][hi], cut[j][hi] = worst, lo
    out, hi = [], n
    for j in range(stages, 0, -1):
        out.append((cut[j][hi], hi))
        hi = cut[j][hi]
    return out[::-1]


def slowest(costs: Costs, split: list[tuple[int, int]], pp: int) -> float:
    """The slowest pipeline rank's fwd+bwd+NS (rank k holds stages k, k+pp, ...)."""
    return max(sum(costs(*split[i]) for i in range(k, len(split), pp)) for k in range(pp))


def pipeline_text(plan: dict) -> list[str]:
    """A plan document's pipeline for a terminal (``python -m service.job.plan --pp``,
    ``dmuon-svc plan``): the layout and mode, the split and what it beats, each stage's
    layers and NS load, each pp rank's ranks, memory and pp bytes. Torch-free."""
    p, lay, m = plan["pipeline"], plan["layout"], plan["modes"]
    gb = 1e9
    mesh = " x ".join(str(lay[k]) for k in ("pp", "replicate", "shard", "tp"))
    out = [f"{'fits' if m['fits'] else 'does not fit'}: layout pp {mesh} (pp x replicate x "
           f"shard x tp{', ep ' + str(lay['ep']) if lay['ep'] > 1 else ''}) on "
           f"{lay['nodes']} nodes; {m['dmuon'].upper()}, worst pp rank "
           f"{max(r['peak_bytes'] for r in p['ranks']) / gb:.1f} GB of "
           f"{m['device_bytes'] / gb:.0f} GB",
           f"schedule {p['schedule']} (v = {p['stages_per_rank']}), {p['micro_batches']} "
           f"micro-batches: bubble {p['bubble']:.3f}; slowest stage (fwd+bwd+NS) "
           f"{p['slowest_s']:.3f} s; by layer count alone {p['by_count']['slowest_s']:.3f} s,"
           f" without the NS step in the split {p['without_ns']['slowest_s']:.3f} s",
           f"{'stage':>5} {'pp rank':>7} {'layers':>9} {'fwd+bwd s':>9} "
           f"{'NS TFLOP/owner':>14} {'NS s':>7} {'total s':>8}  next link"]
    for s in p["stages"]:
        lo, hi = s["layers"]
        what = ("emb + " if s["embedding"] else "") + f"{lo}-{hi - 1}" + (
            " + head" if s["head"] else "")
        out.append(f"{s['stage']:>5} {s['pp_rank']:>7} {what:>9} {s['fwd_bwd_s']:>9.3f} "
                   f"{s['ns_flops_per_owner'] / 1e12:>14.2f} {s['ns_s']:>7.3f} "
                   f"{s['seconds']:>8.3f}  {s['link_next'] or '-'}")
    out.append(f"{'pp rank':>7} {'ranks':>13} {'stages':>8} {'in flight':>9} "
               f"{'peak GB':>8} {'activ GB':>8} {'pp GB fwd/bwd':>14}")
    for r in p["ranks"]:
        ranks = f"{r['ranks'][0]}-{r['ranks'][1]}"
        pp_gb = f"{r['pp_bytes']['forward'] / gb:.1f}/{r['pp_bytes']['backward'] / gb:.1f}"
        out.append(f"{r['pp_rank']:>7} {ranks:>13} {','.join(map(str, r['stages'])):>8} "
                   f"{r['in_flight']:>9} {r['peak_bytes'] / gb:>8.1f} "
                   f"{r['memory']['activations'] / gb:>8.1f} {pp_gb:>14}")
    return out
