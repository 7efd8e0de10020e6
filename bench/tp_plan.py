"""The planner's table under tensor parallelism (``layout.tp``): Llama-3 8B, 70B and 405B
on hosts of 8 GPUs of 80 GB, for T in {1, 2, 4, 8}, with a fixed global batch of 64
sequences of 8192 tokens (torchtitan's Llama 3 batch: 8 per rank on its 64-GPU 70B
preset, 1 per rank in its 1-D runs), one sequence per micro-batch: the smallest host
count whose ranks fit their memory and split the batch, its layout (HSDP, one replica
per host, where that fits, else FSDP over every host: ``replicate: 1``, torchtitan's
``data_parallel_shard_degree = -1``), the mode, one rank's resident memory (its kinds
at rest after a step, the worst rank) and peak (the mode's estimate, with activations),
and the predicted communication time of a step by mesh dim. bf16 compute, fp32 masters
and reduce, per-block activation checkpointing (torchtitan's ``full``). Then the
planner at torchtitan's published layouts.

``python -m bench.tp_plan``: prints the tables and writes the dated record
``bench/results/tp_plan_<machine>_<date>.{md,json}``."""

from __future__ import annotations

import argparse

from bench._record import gb, moved, write_record
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.layout_choice import PlacementError
from service.job.plan.modes import GB
from service.job.plan.predict import needed_bytes, predict
from service.job.spec import SpecError, parse_spec

TP_DIMS = ("shard", "replicate", "tp")  # the bytes-per-step column, GB by dim
GLOBAL_ROWS, SEQ, GPUS_PER_HOST = 64, 8192, 8
# Llama 3.1 405B's published shapes (config.json); 8B and 70B are the built-in presets
LLAMA3_405B = {"vocab_size": 128256, "dim": 16384, "n_layers": 126, "n_heads": 128,
               "n_kv_heads": 8, "ffn_dim": 53248, "max_seq_len": 8192}
MODELS = {"llama3-8b": "llama3-8b", "llama3-70b": "llama3-70b", "llama3-405b": LLAMA3_405B}
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"


def spec(model, layout: dict, *, batch_size: int = 1, global_rows: int = GLOBAL_ROWS,
         device_gb: float = 80.0):
    return parse_spec({
        "model": model, "batch_size": batch_size, "seq_len": SEQ, "steps": 1000,
        "global_batch_tokens": global_rows * SEQ, "activation_checkpointing": "non_reentrant",
        "precision": {"master_dtype": "float32", "param_dtype": "bfloat16",
                      "reduce_dtype": "float32"},
        "dmuon": {"mode": "auto", "device_memory_gb": device_gb}, "layout": layout,
        "resources_per_worker": {"CPU": 1, "GPU": 1}})


def _row(name: str, hosts: int, kind: str, placement) -> dict:
    m, ranks = placement.modes, placement.ranks
    worst = max(ranks, key=lambda r: r.comm_seconds)
    # a rank's share: the logits stay sharded on the vocabulary (loss parallel)
    elt_logits = SEQ * placement.spec.batch_size * 128256 * (2 + 4) // placement.layout.tp
    return {"model": name, "tp": placement.layout.tp, "hosts": hosts, "gpus": placement.world_size,
            "layout": list(placement.layout.mesh_shape), "kind": kind,
            "micro_batches": GLOBAL_ROWS // (placement.layout.dp_size * placement.spec.batch_size),
            "mode": m.dmuon, "fits": m.fits,
            "resident_bytes": max(sum(r.memory.values()) for r in ranks),
            "peak_bytes": needed_bytes(m), "logits_bytes": elt_logits,
            "comm_seconds": worst.comm_seconds,
            "bytes_per_step": {d: sum(p.values()) for d, p in worst.ledger.items()}}


def _layouts(hosts: int, T: int) -> list[tuple[str, dict]]:
    per = GPUS_PER_HOST // T
    hsdp = ("HSDP", {"nodes": hosts, "replicate": hosts, "shard": per, "tp": T})
    fsdp = ("FSDP", {"nodes": hosts, "replicate": 1, "shard": hosts * per, "tp": T})
    return [hsdp] if hosts == 1 else [hsdp, fsdp]


def smallest(name: str, T: int, max_hosts: int) -> dict:
    """The smallest host count whose layout runs at T, or the row saying why none does."""
    tried = []
    for hosts in range(1, max_hosts + 1):
        dp = hosts * GPUS_PER_HOST // T
        if dp > GLOBAL_ROWS:
            break
        if GLOBAL_ROWS % dp:
            continue  # the batch does not split: named in the table's note
        for kind, layout in _layouts(hosts, T):
            try:
                p = predict(spec(MODELS[name], layout),
                            synthetic_inventory(hosts, GPUS_PER_HOST))
            except (PlacementError, SpecError) as e:
                tried.append(f"{hosts} hosts {kind}: {e}")
                continue
            if p.modes.fits:
                return _row(name, hosts, kind, p)
            tried.append(f"{hosts} hosts {kind}: {needed_bytes(p.modes) / GB:.1f} GB")
    return {"model": name, "tp": T, "refused": "no host count runs: " + "; ".join(
        tried[-2:]) + f"; above {GLOBAL_ROWS * T // GPUS_PER_HOST} hosts the "
        f"{GLOBAL_ROWS} sequences give a data-parallel rank less than one"}


def torchtitan_rows() -> list[dict]:
    """The planner at torchtitan's published layouts (its performance page,
    ``TORCHTITAN``, and the llama3 train_configs): 70B 1-D FSDP2 on 64 GPUs (local
    batch 1), its 70B preset FSDP 8 x TP 8 on 64 GPUs (local batch 8), 405B FSDP 16 x
    TP 8 on 128 H100 of 94 GB (local batch 2, global 32)."""
    cases = [("70B 1-D FSDP2, 64 A100", "llama3-70b", 8, {"replicate": 1, "shard": 64}, 1,
              64, 80.0),
             ("70B FSDP 8 x TP 8 preset, 64 A100", "llama3-70b", 8,
              {"replicate": 1, "shard": 8, "tp": 8}, 8, 64, 80.0),
             ("405B FSDP 16 x TP 8, 128 H100", "llama3-405b", 16,
              {"replicate": 1, "shard": 16, "tp": 8}, 2, 32, 94.0)]
    out = []
    for label, name, hosts, layout, batch, rows, device_gb in cases:
        s = spec(MODELS[name], {"nodes": hosts, **layout}, batch_size=batch, global_rows=rows,
                 device_gb=device_gb)
        p = predict(s, synthetic_inventory(hosts, GPUS_PER_HOST))
        row = _row(name, hosts, "torchtitan", p)
        row.update(case=label, micro_batches=rows // (p.layout.dp_size * batch),
                   device_bytes=p.modes.device_bytes)
        out.append(row)
    return out


def _line(r: dict) -> str:
    if "refused" in r:
        return f"| {r['model']} | {r['tp']} | - | - | - | - | - | - | - | - | - | - | " \
               f"{r['refused']} |"
    R, N, T = r["layout"]
    return (f"| {r['model']} | {T} | {r['hosts']} | {r['gpus']} | {R} x {N} x {T} "
            f"({r['kind']}) | {r['micro_batches']} x {SEQ} | {r['mode'].upper()} | "
            f"{gb(r['resident_bytes'])} | {gb(r['peak_bytes'])} | {gb(r['logits_bytes'])} "
            f"| {r['comm_seconds']:.2f} | {moved(r, TP_DIMS)} | runs |")


def _titan_line(r: dict) -> str:
    R, N, T = r["layout"]
    verdict = "fits" if r["fits"] else "does not fit"
    return (f"| {r['case']} | {R} x {N} x {T} | {r['micro_batches']} | "
            f"{r['mode'].upper()} | {gb(r['resident_bytes'])} | {gb(r['peak_bytes'])} of "
            f"{gb(r['device_bytes'])} ({verdict}) | {gb(r['logits_bytes'])} | "
            f"{r['comm_seconds']:.2f} | {moved(r, TP_DIMS)} |")


HEADER = ("| model | T | hosts | GPUs | R x N x T | micro-batches x tokens per rank | mode | "
          "resident GB/rank | peak GB/rank | logits GB | comm s/step | shard / repl / tp "
          "GB/step | |\n|---|---:|---:|---:|---|---|---|---:|---:|---:|---:|---|---|")
TITAN_HEADER = ("| torchtitan's layout | R x N x T | micro-batches | mode | resident GB/rank | "
                "peak GB/rank | logits GB | comm s/step | shard / repl / tp GB/step |\n"
                "|---|---|---:|---|---:|---:|---:|---:|---|")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-hosts", type=int, default=64)
    args = ap.parse_args(argv)
    rows = [smallest(name, T, args.max_hosts) for name in MODELS for T in (1, 2, 4, 8)]
    titan = torchtitan_rows()
    table = "\n".join([HEADER, *map(_line, rows), "", TITAN_HEADER, *map(_titan_line, titan)])
    print(table)
    write_record("tp_plan", "The planner under tensor parallelism: Llama-3 8B, 70B and 405B "
                 "on hosts of 8 x 80 GB, T in {1, 2, 4, 8}", table,
                 {"global_rows": GLOBAL_ROWS, "seq_len": SEQ, "rows": rows, "torchtitan": titan},
                 notes=NOTES)


NOTES = f"""Global batch {GLOBAL_ROWS} x {SEQ} tokens at every layout, one sequence per
micro-batch (more data-parallel ranks: fewer micro-batches). A host count is tried when
its data-parallel ranks (hosts x 8 / T) divide the 64 sequences; at each, HSDP (one
replica per host, sharded over the host's 8 / T shard ranks) first, else FSDP over every
host (`replicate: 1`). Resident: the worst rank's tensors at rest after a step
(dmuon.MEMORY_KINDS); peak: the mode's estimate with activations (service.job.plan.modes),
against 90% of the device. Comm: the slowest rank's bytes per step over 450 GB/s NVLink
(tp, and shard within a host) and 50 GB/s InfiniBand (replicate, and shard over hosts:
FSDP), one after the other, nothing overlapped.

**The head's logits.** `service.job.models.tp_plans` plans the head `ColwiseParallel(output_layouts=
Shard(-1))` and the loss runs under `loss_parallel()` (torchtitan's loss parallel): each TP
rank holds 1/T of the `[rows, seq, vocab]` logits and their fp32 copy (the logits GB
column, per rank: 6.3 GB per sequence of 8192 at vocabulary 128256, over T). The planner
counts them that way (`service.job.plan.tp_costs.logits_split`). Until 2026-12-04 the head gathered
them whole on every TP rank (`bench/results/tp_plan_x86_64-2cpu_2026-12-03.md`).

**Where torchtitan's published layouts sit** ({TORCHTITAN}, and the llama3
`train_configs` of pytorch/torchtitan): Llama 3 70B on 64 A100 80 GB with FSDP2 (1-D, no
TP), local batch 1 (global 64), full activation checkpointing, is the first row of the
second table, 8 hosts at T = 1 with every rank sharded over all 64 (R = 1). Their 2-D
runs (FSDP2 + TP) used the same global batch of 64; their 70B preset
(`llama3_70b.toml`, "a preset for 64 A100 GPUs") is FSDP 8 x TP 8 with local batch 8,
the second row: with the logits sharded over the 8 TP ranks, its peak is the second
table's (it did not fit 80 GB while they were gathered whole on every TP rank). Their
405B runs, 2-D only ("we do see OOM for 1D parallelism"), are FSDP 16 x TP 8 on 128
H100 of 94 GB, local batch 2, global 32: the third row."""


if __name__ == "__main__":
    main()
