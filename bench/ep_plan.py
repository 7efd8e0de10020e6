"""The planner's table under expert parallelism (``layout.ep``): Qwen3-30B-A3B, a Kimi K2
shape and a DeepSeek-V3 shape, as Hugging Face Qwen3-MoE configs on the meta device, on
hosts of 8 GPUs of 80 GB, for P in {1, 8, 16, 32, 64}, with a fixed global batch of 15360
sequences of 4096 tokens (DeepSeek-V3's batch after its ramp; Kimi K2's was 67M tokens),
one sequence per micro-batch: the smallest host count whose ranks fit their memory and
split the batch, its layout (HSDP, one replica per host, where P divides a host's 8
shard ranks and that fits, else FSDP over every host: ``replicate: 1``; P must divide the
shard size N, so P > 8 needs a shard group over several hosts), the mode, one rank's
resident memory (its kinds at rest after a step, the worst rank) and peak (the mode's
estimate, with activations), the predicted bytes of a step by mesh dim and their time,
and which link the ``ep`` dim's all-to-alls cross. bf16 compute, fp32 masters and
reduce, per-block activation checkpointing. Then the planner at published layouts.

``python -m bench.ep_plan``: prints the tables and writes the dated record
``bench/results/ep_plan_<machine>_<date>.{md,json}``."""

from __future__ import annotations

import argparse
import time

from bench._record import gb, moved, write_record
from service.job.models.source import ModelSource
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.layout_choice import PlacementError
from service.job.plan.modes import GB, HEADROOM
from service.job.plan.moe_shapes import (  # noqa: F401 (the record names them)
    BOUNDARIES,
    DEEPSEEK_V3,
    DEEPSEEK_V3_URL,
    KIMI_K2,
    KIMI_K2_REPORT,
    KIMI_K2_URL,
    QWEN3_30B_A3B,
    QWEN3_30B_A3B_URL,
)
from service.job.plan.moe_shapes import (
    MOE_SHAPES as MODELS,
)
from service.job.plan.predict import MetaModel, needed_bytes, predict
from service.job.spec import SpecError, parse_spec

EP_DIMS = ("shard", "replicate", "ep")  # the bytes-per-step column, GB by dim
GLOBAL_ROWS, SEQ, GPUS_PER_HOST, DEVICE_GB = 15360, 4096, 8, 80.0
EPS = (1, 8, 16, 32, 64)
# bf16 compute, fp32 masters: per parameter a shard group holds at least its bf16 shard
# column (2 bytes over N: FSDP2's fp32 shards hold more) and the replicas together an fp32
# master, momentum (AdamW: two moments) and gradient (12 bytes over R x N)
COLUMN_BYTES, OWNED_BYTES = 2, 12


def spec(config: dict, layout: dict, *, global_rows: int = GLOBAL_ROWS):
    return parse_spec({
        "model": {"hf_arch": "Qwen3MoeForCausalLM", "config": config}, "batch_size": 1,
        "seq_len": SEQ, "steps": 1000, "global_batch_tokens": global_rows * SEQ,
        "activation_checkpointing": "non_reentrant",
        "precision": {"master_dtype": "float32", "param_dtype": "bfloat16",
                      "reduce_dtype": "float32"},
        "dmuon": {"mode": "auto", "device_memory_gb": DEVICE_GB,
                  "hook_boundaries": BOUNDARIES},
        "layout": layout, "resources_per_worker": {"CPU": 1, "GPU": 1}})


class Planner:
    """One model's placements, its meta model built once for every layout weighed."""

    def __init__(self, name: str):
        self.name, self.config = name, MODELS[name]
        self.meta = MetaModel(spec(self.config, {}), ModelSource(kind="hf",
                                                                 config=self.config))
        self.params = sum(p.numel() for p in self.meta.prepared().model.parameters())
        self.seconds: list[float] = []  # wall time of each placement predicted

    def place(self, hosts: int, layout: dict, global_rows: int = GLOBAL_ROWS):
        t0 = time.perf_counter()
        try:
            return predict(spec(self.config, {"nodes": hosts, "tp": 1, **layout},
                                global_rows=global_rows),
                           synthetic_inventory(hosts, GPUS_PER_HOST), model_source=self.meta)
        finally:
            self.seconds.append(time.perf_counter() - t0)

    def floor_refuses(self, replicate: int, shard: int) -> bool:
        """An R x N layout whose ranks' average of the bytes every layout holds per
        parameter exceeds what a rank may use: its worst rank cannot fit either."""
        floor = self.params * (COLUMN_BYTES / shard + OWNED_BYTES / (replicate * shard))
        return floor > HEADROOM * DEVICE_GB * GB


def ep_link(placement) -> str:
    """The link the ``ep`` dim crosses: a host's NVLink when the EP group's P ranks lie
    inside one host (predict's ``ep_in_node``), else InfiniBand."""
    per_host = placement.world_size // placement.layout.nodes
    return "NVLink" if per_host % (placement.layout.ep * placement.layout.tp) == 0 else "IB"


def _row(name: str, hosts: int, kind: str, p, global_rows: int = GLOBAL_ROWS) -> dict:
    m, ranks = p.modes, p.ranks
    worst = max(ranks, key=lambda r: r.comm_seconds)
    return {"model": name, "ep": p.layout.ep, "hosts": hosts, "gpus": p.world_size,
            "layout": [p.layout.replicate, p.layout.shard], "kind": kind, "ep_link": ep_link(p),
            "micro_batches": global_rows // (p.layout.dp_size * p.spec.batch_size),
            "mode": m.dmuon, "fits": m.fits, "params": m.params,
            "resident_bytes": max(sum(r.memory.values()) for r in ranks),
            "peak_bytes": needed_bytes(m), "packed_peak_bytes": max(r.packed_peak
                                                                   for r in ranks),
            "device_bytes": m.device_bytes, "imbalance": p.plan.imbalance,
            "comm_seconds": worst.comm_seconds,
            "bytes_per_step": {d: sum(v.values()) for d, v in worst.ledger.items()}}


def _layouts(hosts: int, P: int) -> list[tuple[str, dict]]:
    hsdp = ("HSDP", {"replicate": hosts, "shard": GPUS_PER_HOST, "ep": P})
    fsdp = ("FSDP", {"replicate": 1, "shard": hosts * GPUS_PER_HOST, "ep": P})
    out = [hsdp] if GPUS_PER_HOST % P == 0 else []
    return out + ([fsdp] if hosts > 1 or not out else [])


def smallest(planner: Planner, P: int, max_hosts: int) -> dict:
    """The smallest host count whose layout runs at P, or the row saying why none does."""
    tried, floor = [], None
    for hosts in range(1, max_hosts + 1):
        if GLOBAL_ROWS % (hosts * GPUS_PER_HOST):
            continue  # the batch does not split: named in the notes
        for kind, layout in _layouts(hosts, P):
            if (hosts * GPUS_PER_HOST) % P == 0 and planner.floor_refuses(
                    layout["replicate"], layout["shard"]):
                floor = f"{hosts} hosts {kind}"  # below the floor: not predicted
                continue
            try:
                p = planner.place(hosts, layout)
            except (PlacementError, SpecError) as e:
                tried.append(f"{hosts} hosts {kind}: {e}")
                continue
            if p.modes.fits:
                row = _row(planner.name, hosts, kind, p)
                row["last_below_floor"] = floor
                return row
            tried.append(f"{hosts} hosts {kind}: {needed_bytes(p.modes) / GB:.1f} GB")
    return {"model": planner.name, "ep": P, "refused": f"no host count up to {max_hosts} "
            "runs: " + "; ".join(tried[-2:])}


def published_rows(planners: dict[str, Planner]) -> list[dict]:
    """The planner at published layouts, as far as it models them: Megatron's
    Qwen3-30B-A3B recipe (DP 8 x EP 8 on one host) and Kimi K2's 256-GPU model-parallel
    group (PP 16 x EP 16; no PP here: the same 256 GPUs as FSDP 256 with EP 16)."""
    cases = [("Qwen3-30B-A3B DP 8 x EP 8, 1 host (Megatron recipe)", "qwen3-30b-a3b", 1,
              {"replicate": 1, "shard": 8, "ep": 8}),
             ("Kimi K2 PP 16 x EP 16 as FSDP 256 x EP 16, 32 hosts", "kimi-k2-shape", 32,
              {"replicate": 1, "shard": 256, "ep": 16})]
    out = []
    for label, name, hosts, layout in cases:
        row = _row(name, hosts, "published", planners[name].place(hosts, layout))
        row["case"] = label
        out.append(row)
    return out


def _line(r: dict) -> str:
    if "refused" in r:
        return f"| {r['model']} | {r['ep']} | - | - | - | - | - | - | - | - | - | - | - | " \
               f"{r['refused']} |"
    R, N = r["layout"]
    return (f"| {r['model']} | {r['ep']} | {r['hosts']} | {r['gpus']} | {R} x {N} "
            f"({r['kind']}) | {r['ep_link']} | {r['micro_batches']} | {r['mode'].upper()} | "
            f"{gb(r['resident_bytes'])} | {gb(r['peak_bytes'])} | "
            f"{gb(r['packed_peak_bytes'])} | {r['comm_seconds']:.1f} | "
            f"{moved(r, EP_DIMS, ',.0f')} | runs |")


def _published_line(r: dict) -> str:
    R, N = r["layout"]
    verdict = "fits" if r["fits"] else "does not fit"
    return (f"| {r['case']} | {R} x {N}, P = {r['ep']} | {r['ep_link']} | "
            f"{r['micro_batches']} | {r['mode'].upper()} | {gb(r['resident_bytes'])} | "
            f"{gb(r['peak_bytes'])} of {gb(r['device_bytes'])} ({verdict}) | "
            f"{r['comm_seconds']:.1f} | {moved(r, EP_DIMS, ',.0f')} |")


HEADER = ("| model | P | hosts | GPUs | R x N | ep link | micro-batches per rank | mode | "
          "resident GB/rank | peak GB/rank | packed peak GB | comm s/step | "
          "shard / repl / ep GB/step | |\n"
          "|---|---:|---:|---:|---|---|---:|---|---:|---:|---:|---:|---|---|")
PUBLISHED_HEADER = ("| published layout | R x N, P | ep link | micro-batches per rank | mode | "
                    "resident GB/rank | peak GB/rank | comm s/step | "
                    "shard / repl / ep GB/step |\n|---|---|---|---:|---|---:|---:|---:|---|")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-hosts", type=int, default=128)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    planners = {name: Planner(name) for name in args.models}
    rows = [smallest(planners[name], P, args.max_hosts) for name in args.models for P in EPS]
    published = published_rows(planners) if set(args.models) == set(MODELS) else []
    table = "\n".join([HEADER, *map(_line, rows)]
                      + (["", PUBLISHED_HEADER, *map(_published_line, published)]
                         if published else []))
    print(table)
    timings = {name: {"params": p.params, "placements": len(p.seconds),
                      "seconds": round(sum(p.seconds), 1),
                      "slowest_s": round(max(p.seconds, default=0), 1)}
               for name, p in planners.items()}
    total = time.perf_counter() - t0
    print(f"{total:.0f} s in all; per model: {timings}")
    write_record("ep_plan", "The planner under expert parallelism: Qwen3-30B-A3B, Kimi K2 "
                 "and DeepSeek-V3 shapes on hosts of 8 x 80 GB, P in {1, 8, 16, 32, 64}",
                 table, {"global_rows": GLOBAL_ROWS, "seq_len": SEQ, "configs": {
                     n: MODELS[n] for n in args.models}, "hook_boundaries": BOUNDARIES,
                     "rows": rows, "published": published, "timings": timings,
                     "seconds": round(total, 1)},
                 notes=notes(timings, total))


def _setup_notes(timings: dict) -> str:
    """The record's notes on the models, the batch and the search."""
    params = ", ".join(f"{n} {t['params'] / 1e9:,.1f}B" for n, t in timings.items())
    return f"""**Models** (parameters as built: {params}). Qwen3-30B-A3B is its published
config ({QWEN3_30B_A3B_URL}): hidden 2048, 48 layers, 32 heads of 128, 4 KV heads, 128
experts of width 768, top 8, vocabulary 151936. The Kimi K2 shape takes Kimi K2's expert
counts and widths ({KIMI_K2_URL}): 384 experts of width 2048, top 8, hidden 7168, 61 layers
(the first dense, FFN 18432), vocabulary 163840, 64 heads; the DeepSeek-V3 shape
({DEEPSEEK_V3_URL}) the same widths with 256 experts, 128 heads, 3 dense layers and
vocabulary 129280. Both are written as Qwen3-MoE configs: GQA attention (heads of 128, 8
KV heads) in place of their MLA, and without their one shared expert per layer (Qwen3-MoE
has none; 61 x 3 x 7168 x 2048 = 2.7B parameters, 0.3% of K2). That changes attention's
few percent of the parameters, not the experts, which are what EP splits.

**Batch and search.** Global batch {GLOBAL_ROWS} x {SEQ} tokens (63M) at every layout,
one sequence per micro-batch; the ep and shard bytes per step scale with the tokens a rank
runs, so the comm column is a step of that batch. A host count is tried when its data-
parallel ranks (hosts x 8: EP ranks are data-parallel ranks) divide the {GLOBAL_ROWS}
sequences; at each, HSDP (one replica per host, N = 8) when P divides 8, else or then FSDP
over every host (`replicate: 1`, N = hosts x 8); P must divide N. A layout is skipped
without a prediction when the average a rank must hold, {COLUMN_BYTES} bytes per parameter
over N (the bf16 shard column; AdamW's fp32 FSDP2 shards hold more) and {OWNED_BYTES} over
R x N (fp32 master, momentum or AdamW's moments, fp32 gradient), exceeds 90% of 80 GB: its
worst rank holds at least that average. (At one replica per host N = 8, so the Kimi and
DeepSeek shapes' bf16 columns alone, 256 and 168 GB, rule HSDP out.)
Resident: the worst rank's tensors at rest after a
step (dmuon.MEMORY_KINDS); peak: the mode's estimate with activations (the planner's dense
estimate: the experts' dispatched rows, n x k x hidden per MoE layer, are not counted);
packed peak: DMuon's Z3 window of packed buffers (two boundaries). Comm: the slowest
rank's bytes per step over 450 GB/s NVLink and 50 GB/s InfiniBand, one after the other,
nothing overlapped; the ep link column is predict's `ep_in_node`: NVLink when P divides a
host's 8 GPUs, else InfiniBand (FSDP's shard dim crosses hosts whenever N > 8)."""


def notes(timings: dict, total: float) -> str:
    slow = ", ".join(f"{n}: {t['placements']} placements in {t['seconds']:.0f} s (slowest "
                     f"{t['slowest_s']:.0f} s)" for n, t in timings.items())
    return _setup_notes(timings) + f"""

**Hook boundaries.** Every spec sets `dmuon.hook_boundaries: {BOUNDARIES}`: attention and
the MLP (the experts' module, with the router, which is AdamW) are separate DMuon
boundaries. The workers refuse a boundary holding expert-parallel and other params; the
service's default split (`service/job/models/params.py`) makes every module holding 3-D
Muon params (the experts) a boundary of its own, nested in its decoder layer, so a job
that sets nothing gets the experts apart too (with the attention and the router in the
layer's boundary); a boundary holding a whole layer would count all of its experts, not
E/P of them, in the Z3 window (Kimi K2 shape, 32 hosts, P = 8: packed peak 68 GB instead
of 4.5 GB).

**Where the published layouts sit.** Kimi K2 trained with pipeline parallelism (virtual
stages), 16-way EP and ZeRO-1 data parallelism, a model-parallel group of 256 GPUs holding
about 30 GB of states per GPU ({KIMI_K2_REPORT}, section 2.4). DMuon has no PP: the second
table plans the same 256 GPUs as FSDP over all of them with P = 16, so the ep group spans
two hosts and the shard dim's gathers cross InfiniBand. There it does not fit: FSDP keeps
the fp32 master, momentum and gradient (12 bytes per parameter) on those 256 ranks alone,
about 48 GB each before any gather or activation, where K2's 30 GB holds bf16 parameters
and an fp32 gradient buffer (6 bytes per parameter, "about 6 TB" over 256 GPUs) and
ZeRO-1 spreads the optimizer states over every data-parallel replica as well; HSDP here
replicates them instead. The first table's Kimi rows are the host counts where it fits.
Megatron's Qwen3-30B-A3B recipe runs DP 8 x EP 8 on one host: `1 x 8` with P = 8, the
first table's row.

**Reading the ep column.** The ep bytes are the all-to-alls of {GLOBAL_ROWS} x {SEQ} tokens
spread over the ranks: they fall with more ranks (fewer tokens each), not with P (the
share leaving a rank, (P-1)/P, grows with P). What P buys is in the shard column and the
packed peak: a rank gathers only its EP coordinate's E/P experts over its N/P expert
shard group (at P = N, none). P > 8 puts the all-to-alls on InfiniBand (9x slower here),
which is why the comm time jumps from P = 8 to P = 16.

**Planner time** on this machine (2 cores shared with other work): {slow}; {total:.0f} s
for the whole bench. Most of a large placement is O(units x ranks) work in `dmuon`: the
partition's greedy (`dmuon/partition.py`, a `min` over the ranks for each of ~46k units at
P = 1) and `dmuon.cost`'s per-rank helpers, each of which recomputes a plan-wide list
(`column_elements`, `elements_per_rank`, `gathered_elements`) over every unit on every
call. The planner's own loops (`choose_mode`, `_ranks`) now take those lists once per
placement, and `choose_mode` one pass over the ranks for Z2 and Z3 together (the 2026-12-04
change; before it the slowest placement, Kimi K2 shape at P = 1 on 80 hosts, took 72 s while
the machine was busier)."""


if __name__ == "__main__":
    main()
