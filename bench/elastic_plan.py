"""The planner's table for an elastic job (``layout.elastic``): Llama-3 8B and 70B on 1 to
8 hosts of 8 GPUs of 80 GB, the layout each host count runs (one replica per host,
sharded over its 8 GPUs), how its ranks split a fixed global batch of 3,360 sequences of
8192 tokens (27.5M), the mode, and one rank's resident memory (its kinds at rest after a step,
the worst rank) and peak (the mode's estimate, with activations). bf16 compute, fp32
masters and reduce, per-block activation checkpointing. A host count whose ranks cannot
split the batch evenly, or whose rank would not fit 80 GB, is refused with the reason.

``python -m bench.elastic_plan [--max-nodes 8]``: prints the table and writes the dated
record ``bench/results/elastic_plan_<machine>_<date>.{md,json}``."""

from __future__ import annotations

import argparse

from bench._record import write_record
from service.job.plan.elastic import elastic_document
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.modes import GB
from service.job.spec import SpecError, parse_spec

# 3360 = 8 x lcm(1..7): 1 to 7 hosts of 8 GPUs split it evenly, 8 hosts (64) do not
GLOBAL_ROWS, SEQ = 3360, 8192


def spec(model: str, max_nodes: int):
    return parse_spec({
        "model": model, "batch_size": 1, "seq_len": SEQ, "steps": 1000,
        "global_batch_tokens": GLOBAL_ROWS * SEQ, "checkpoint": {"interval": 100},
        "activation_checkpointing": "non_reentrant",
        "precision": {"master_dtype": "float32", "param_dtype": "bfloat16",
                      "reduce_dtype": "float32"},
        "dmuon": {"mode": "auto", "device_memory_gb": 80.0},
        "layout": {"elastic": {"min_nodes": 1, "max_nodes": max_nodes}},
        "resources_per_worker": {"CPU": 1, "GPU": 1}})


def rows_of(model: str, max_nodes: int) -> list[dict]:
    node = synthetic_inventory(1, 8)[0]
    try:
        plan = elastic_document(spec(model, max_nodes), node, {"source": "assumed", "nodes": 1})
    except SpecError as e:  # no host count runs: the reason is the row
        return [{"model": model, "refused": str(e)}]
    out = []
    for e in plan.elastic:
        resident = max((sum(r.memory.values()) for r in e.ranks), default=None)
        m = e.modes
        out.append({"model": model, "nodes": e.layout.nodes, "workers": e.layout.world_size,
                    "layout": [e.layout.replicate, e.layout.shard],
                    "micro_batches": e.micro_batches, "rows_per_micro": e.rows_per_micro,
                    "mode": m.dmuon if m else None,
                    "resident_bytes": resident, "peak_bytes": (m.z3_bytes if m.dmuon == "z3"
                                                               else m.z2_bytes) if m else None,
                    "refused": e.refused})
    return out


def _line(r: dict) -> str:
    if "nodes" not in r:
        return f"| {r['model']} | - | - | - | - | - | - | - | {r['refused']} |"
    gb = lambda b: f"{b / GB:.1f}" if b is not None else "-"  # noqa: E731
    split = f"{r['micro_batches']} x {r['rows_per_micro']}" if r["micro_batches"] else "-"
    return (f"| {r['model']} | {r['nodes']} | {r['workers']} | {r['layout'][0]} x "
            f"{r['layout'][1]} | {split} | {(r['mode'] or '-').upper()} | "
            f"{gb(r['resident_bytes'])} | {gb(r['peak_bytes'])} | {r['refused'] or 'runs'} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-nodes", type=int, default=8)
    args = ap.parse_args(argv)
    rows = [r for model in ("llama3-8b", "llama3-70b") for r in rows_of(model, args.max_nodes)]
    table = "\n".join([
        "| model | hosts | GPUs | R x N | micro-batches x rows per GPU | mode | "
        "resident GB/rank | peak GB/rank | |",
        "|---|---:|---:|---|---|---|---:|---:|---|", *map(_line, rows)])
    print(table)
    write_record("elastic_plan", "The elastic planner's table: Llama-3 on 1 to "
                 f"{args.max_nodes} hosts of 8 x 80 GB", table, {"rows": rows},
                 notes=f"Global batch {GLOBAL_ROWS} x {SEQ} tokens; resident: the worst "
                 "rank's tensors at rest after a step (dmuon.MEMORY_KINDS); peak: the mode's "
                 "estimate with activations (service.job.plan.modes).")


if __name__ == "__main__":
    main()
