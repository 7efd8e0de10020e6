"""The planner under pipeline parallelism (``layout.pp``), and one pipeline measured.

1. Llama-3 405B on 128 hosts of 8 x 80 GB (1024 GPUs), TP 8 inside a host, PP in {1, 4,
   8, 16}, FSDP over the rest (``replicate: 1``), a global batch of 2048 sequences of 8192
   tokens (16M tokens, Llama 3's batch after its ramp), one sequence per micro-batch.
2. The Kimi K2 shape (``bench.ep_plan``'s: 61 layers, 384 experts) on 256 GPUs at its
   published PP 16 x EP 16 and at PP 4 x DP 64 x EP 64 (NVIDIA's GB300 run), with
   ``bench.ep_plan``'s batch of 15360 x 4096.
3. The stage split with and without the optimizer step's NS FLOPs in it: the planner's
   split, the split by layer count and the split that leaves NS out, each costed with
   NS, on a head-heavy model and on 405B.
4. Measured on this machine (``bench.pp_measure``): PP 2 x FSDP 2 against FSDP 4.

bf16 compute, fp32 masters and reduce, per-block activation checkpointing, 1F1B, DMuon
mode ``auto`` (the planner's), 400 TFLOP/s per GPU (the planner's ``Costs``).

``python -m bench.pp_plan``: prints the tables and writes the dated record
``bench/results/pp_plan_<machine>_<date>.{md,json}``; ``--measured-from RECORD.json``
copies table 4 from an earlier record instead of measuring it again (the planner's
tables are arithmetic, the same on any machine; a measurement is not, on a busy one)."""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import time

from bench import ep_plan
from bench._record import gb, write_record
from bench.pp_measure import GLOBAL_ROWS as GLOBAL_ROWS_MEASURED
from bench.tp_plan import LLAMA3_405B
from service.job.models.source import ModelSource
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.modes import activation_bytes
from service.job.plan.pipeline_plan import pipeline_placement
from service.job.plan.predict import MetaModel, needed_bytes, predict
from service.job.spec import parse_spec

LLAMA3_PAPER = "https://arxiv.org/abs/2407.21783"  # section 3.3.2: TP 8 x CP 1 x PP 16 x DP 128
HOSTS_405B, ROWS_405B, SEQ_405B = 128, 2048, 8192
# a head-heavy model: 8 layers of a 4096-wide model, a 256k vocabulary (must-show 6's shape)
HEAD_HEAVY = {"vocab_size": 256000, "dim": 4096, "n_layers": 8, "n_heads": 32,
              "n_kv_heads": 32, "ffn_dim": 11008, "max_seq_len": 8192}


def dense_spec(model, layout: dict, global_rows: int, seq: int = SEQ_405B):
    return parse_spec({
        "model": model, "batch_size": 1, "seq_len": seq, "steps": 1000,
        "global_batch_tokens": global_rows * seq, "activation_checkpointing": "non_reentrant",
        "precision": {"master_dtype": "float32", "param_dtype": "bfloat16",
                      "reduce_dtype": "float32"},
        "dmuon": {"mode": "auto", "device_memory_gb": 80.0}, "layout": layout,
        "resources_per_worker": {"CPU": 1, "GPU": 1}})


def summary(label: str, lay, plan) -> dict:
    """One pipeline plan as a row: its worst pp rank's peak, bubble, stages and bytes."""
    d = plan.to_dict()
    worst = max(d["ranks"], key=lambda r: r["peak_bytes"])
    pp_bytes = max(sum(r["pp_bytes"].values()) for r in d["ranks"])
    return {"layout": label, "mesh": list(lay.mesh_shape), "pp": lay.pp,
            "micro_batches": lay.micro_batches, "bubble": d["bubble"],
            "slowest_s": d["slowest_s"], "step_s": d["slowest_s"] / (1 - d["bubble"]),
            "peak_bytes": worst["peak_bytes"], "worst_pp_rank": worst["pp_rank"],
            "memory": worst["memory"], "mode": plan.modes.dmuon, "fits": plan.modes.fits,
            "device_bytes": plan.modes.device_bytes, "pp_bytes": pp_bytes,
            "pp_links": sorted({x for r in d["ranks"] for x in r["links"]}),
            "split": [s["layers"] for s in d["stages"]],
            "stage_s": [s["seconds"] for s in d["stages"]],
            "by_count": d["by_count"], "without_ns": d["without_ns"]}


def llama_rows(hosts: int = HOSTS_405B, pps=(1, 4, 8, 16), model=None,
               rows: int = ROWS_405B, seq: int = SEQ_405B) -> list[dict]:
    """405B at each pp: TP 8, FSDP over the rest; pp 1 also through ``predict``."""
    model = model or LLAMA3_405B
    nodes, meta, out = synthetic_inventory(hosts, 8), None, []
    for pp in pps:
        shard = hosts * 8 // (8 * pp)
        s = dense_spec(model, {"nodes": hosts, "replicate": 1, "shard": shard, "tp": 8,
                               "pp": pp}, rows, seq)
        meta = meta or MetaModel(s, None)
        lay, plan = pipeline_placement(s, nodes, meta, pp, projection=True)
        row = summary(f"PP {pp} x TP 8 x FSDP {shard}", lay, plan)
        if pp == 1:  # the planner's usual path for pp 1, beside the pipeline's estimate
            p = predict(s, nodes, model_source=meta)
            row["predict_peak_bytes"], row["predict_fits"] = needed_bytes(p.modes), p.modes.fits
        out.append(row)
    return out


def kimi_rows() -> list[dict]:
    """The Kimi K2 shape on 32 hosts at its two published pipeline layouts."""
    cfg = ep_plan.MODELS["kimi-k2-shape"]
    cases = [("PP 16 x EP 16 (Kimi K2's)", {"pp": 16, "shard": 16, "ep": 16}),
             ("PP 4 x DP 64 x EP 64 (NVIDIA GB300)", {"pp": 4, "shard": 64, "ep": 64})]
    meta, out = None, []
    for label, layout in cases:
        s = ep_plan.spec(cfg, {"nodes": 32, "replicate": 1, "tp": 1, **layout})
        meta = meta or MetaModel(s, ModelSource(kind="hf", config=cfg))
        lay, plan = pipeline_placement(s, synthetic_inventory(32, 8), meta, projection=True)
        out.append(summary(label, lay, plan))
    return out


def head_heavy_rows(llama: list[dict], kimi: list[dict]) -> list[dict]:
    """The head-heavy model at must-show 6's shape (PP 4 x FSDP 8, 8 x 8192 tokens per
    rank) and at 32 layers with few tokens (PP 4 on 4 GPUs, 4 x 512 tokens: NS weighs
    most), then 405B's pipelines (table 1) and Kimi K2's (table 2)."""
    cases = [("head-heavy 8 layers: PP 4 x FSDP 8, 4 hosts, 8 x 8192 tokens/rank",
              HEAD_HEAVY, 4, 8, 8, 64, 8192),
             ("head-heavy 32 layers: PP 4 x FSDP 1, 4 GPUs, 4 x 512 tokens/rank",
              dict(HEAD_HEAVY, n_layers=32), 1, 4, 1, 4, 512)]
    rows = []
    for label, model, hosts, gpus, shard, global_rows, seq in cases:
        s = dense_spec(model, {"nodes": hosts, "replicate": 1, "shard": shard, "tp": 1,
                               "pp": 4}, global_rows, seq)
        lay, plan = pipeline_placement(s, synthetic_inventory(hosts, gpus), MetaModel(s, None),
                                       projection=True)
        rows.append(summary(label, lay, plan))
    return rows + [dict(r, layout="405B " + r["layout"]) for r in llama if r["pp"] > 1] + \
        [dict(r, layout="Kimi K2 shape " + r["layout"]) for r in kimi]


def _fits(r: dict) -> str:
    return f"{gb(r['peak_bytes'])} of {gb(r['device_bytes'])} " + \
        ("(fits)" if r["fits"] else "(does not fit)")


def llama_table(rows: list[dict]) -> str:
    lines = ["| layout | micro-batches | bubble | slowest stage s | step s | mode | "
             "peak GB/GPU (worst pp rank) | pp GB/step per GPU | pp link |",
             "|---|---:|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['micro_batches']} | {r['bubble']:.3f} | "
                     f"{r['slowest_s']:.1f} | {r['step_s']:.1f} | {r['mode'].upper()} | "
                     f"{_fits(r)} | {gb(r['pp_bytes'])} | "
                     f"{', '.join(r['pp_links']) or '-'} |")
    return "\n".join(lines)


def kimi_table(rows: list[dict]) -> str:
    lines = ["| layout (256 GPUs) | micro-batches | bubble | slowest stage s | mode | "
             "peak GB/GPU (worst pp rank) | of which states / activations / packed GB | "
             "pp GB/step per GPU |", "|---|---:|---:|---:|---|---|---|---:|"]
    for r in rows:
        m = r["memory"]
        states = sum(m[k] for k in ("owned_params", "momentum", "gradients", "fsdp_shards",
                                    "adamw_state"))
        lines.append(f"| {r['layout']} | {r['micro_batches']} | {r['bubble']:.3f} | "
                     f"{r['slowest_s']:.1f} | {r['mode'].upper()} | {_fits(r)} | "
                     f"{gb(states)} / {gb(m['activations'])} / {gb(m['packed_buffers'])} | "
                     f"{gb(r['pp_bytes'])} |")
    return "\n".join(lines)


def _cuts(split) -> str:
    return " ".join(f"{lo}-{hi - 1}" for lo, hi in split)


def split_table(rows: list[dict]) -> str:
    lines = ["| model, layout | split with the step (planner) | slowest s | by count | "
             "slowest s | without NS | slowest s |", "|---|---|---:|---|---:|---|---:|"]
    for r in rows:
        c, w = r["by_count"], r["without_ns"]
        lines.append(f"| {r['layout']} | {_cuts(r['split'])} | {r['slowest_s']:.2f} | "
                     f"{_cuts(c['layers'])} | {c['slowest_s']:.2f} | {_cuts(w['layers'])} | "
                     f"{w['slowest_s']:.2f} |")
    return "\n".join(lines)


def measured_table(rows: list[dict]) -> str:
    lines = ["| layout (4 gloo ranks) | shard KB/step | pp KB/step (fwd from pp rank 0 / bwd "
             "from pp rank 1 / step's agreement) | step s (median) | "
             "bubble measured (pp rank 0 / 1) | bubble predicted |",
             "|---|---:|---|---:|---|---:|"]
    for r in rows:
        ph = r["pp_phases_by_rank"]
        pp = (f"{ph[0].get('forward', 0) / 1e3:.1f} / {ph[-1].get('backward', 0) / 1e3:.1f} "
              f"/ {ph[0].get('step', 0):.0f} B") if ph[0] else "-"
        bub = " / ".join(f"{b:.2f}" for b in r["bubble_by_pp_rank"]) \
            if "bubble_by_pp_rank" in r else "-"
        pred = f"{r['bubble_predicted']:.2f}" if "bubble_predicted" in r else "-"
        lines.append(f"| {r['layout']} | {r['bytes'].get('shard', 0) / 1e3:,.1f} | {pp} | "
                     f"{r['step_s']:.3f} | {bub} | {pred} |")
    return "\n".join(lines)


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def _measured(args) -> tuple[list[dict], dict | None]:
    """(table 4's rows, the record they were copied from: its name, date, CPU and
    seconds, or None when measured now or not at all)."""
    if args.measured_from:
        path = pathlib.Path(args.measured_from)
        old = json.loads(path.read_text())
        return old["measured"], {"record": path.with_suffix(".md").name, "date": old["date"],
                                 "cpu": old["cpu"], "seconds": old["seconds"]}
    if args.no_measure:
        return [], None
    from bench.pp_measure import measured as run_measured
    return run_measured(), None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-measure", action="store_true", help="the planner's tables only")
    ap.add_argument("--measured-from", metavar="RECORD.json",
                    help="copy the measured table from this earlier record, not re-run")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    llama = llama_rows()
    kimi = kimi_rows()
    splits = head_heavy_rows(llama, kimi)
    measured, copied = _measured(args)
    cpu = copied["cpu"] if copied else cpu_model()
    tables = [llama_table(llama), kimi_table(kimi), split_table(splits)] + \
        ([measured_table(measured)] if measured else [])
    table = "\n\n".join(tables)
    print(table)
    total = time.perf_counter() - t0
    print(write_record("pp_plan", "The planner under pipeline parallelism: Llama-3 405B, "
                       "the Kimi K2 shape, the stage split; PP 2 x FSDP 2 measured", table,
                       {"llama3_405b": llama, "kimi_k2_shape": kimi, "splits": splits,
                        "measured": measured, "measured_from": copied, "cpu": cpu,
                        "ns_dtype": "float32", "seconds": round(total, 1)},
                       notes=notes(llama, kimi, splits, measured, cpu, total, copied)))


def _planner_notes(llama: list[dict], kimi: list[dict]) -> str:
    p1, p16 = llama[0], llama[-1]
    k16, k4 = kimi
    k16_states = sum(k16["memory"][k] for k in ("owned_params", "momentum", "gradients"))
    return f"""**Llama-3 405B** (126 layers, hidden 16384, FFN 53248, 128 heads, 8 KV heads,
vocabulary 128256; `bench.tp_plan`'s config) on {HOSTS_405B} hosts = {HOSTS_405B * 8} GPUs,
a global batch of {ROWS_405B} x {SEQ_405B} tokens. The published layout is TP 8 x CP 1 x
PP 16 x DP 128 on 16,384 H100s (Llama 3 paper, {LLAMA3_PAPER}, section 3.3.2, table 4);
at 1024 GPUs the same TP 8 x PP 16 leaves FSDP 8. Every row fits: FSDP over all the
data-parallel ranks already spreads the states, so PP here trades the states' share
per GPU for 1F1B's micro-batches in flight (pp on the first stage: at PP 16 its
activations are {gb(p16['memory']['activations'])} GB of its {gb(p16['peak_bytes'])} GB).
{_pp1_notes(p1, llama[1])} The slowest stage's seconds are its
rank's forward, backward (recomputed: checkpointing) and NS for the step's m
micro-batches at 400 TFLOP/s, no communication: the work per GPU is the same at every pp
(so are its tokens), PP adds the rounding of 126 layers into stages (8 layers on the
slowest at PP 4, 8 and 16 against 126/pp) and the bubble; step s = slowest / (1 -
bubble). The pp bytes are one GPU's sends per step, m x rows x seq x hidden x 2 bytes
/ TP each way (a stage of FSDP x TP GPUs spans hosts, so every boundary crosses
InfiniBand): {gb(p16['pp_bytes'])} GB at PP 16, 0.34 s at 50 GB/s.

**Kimi K2 shape** (`bench.ep_plan`'s Qwen3-MoE config: 61 layers, the first dense, 384
experts of width 2048, top 8, hidden 7168) on 32 hosts, `replicate: 1`, batch 15360 x
4096. Its own layout, PP 16 x EP 16 (Kimi K2 report, {ep_plan.KIMI_K2_REPORT}, section
2.4), {'fits' if k16['fits'] else 'does not fit'} at {gb(k16['peak_bytes'])} of 80 GB: each stage's
states (bf16 column, fp32 master, momentum and gradient, {gb(k16_states)} GB per GPU)
lie on its 16 GPUs alone, 1/16 of the model on 16 GPUs, the same share per GPU as FSDP
256 x EP 16 (84.8 GB in ep_plan_x86_64-2cpu_2026-12-04): PP on the same 256 GPUs does
not cut the states; what PP 16 saves is activations: 1F1B keeps pp - k micro-batches in
flight on pp rank k, all but the one in backward as their blocks' inputs alone under
checkpointing (the worst, pp rank {k16['worst_pp_rank']}:
{gb(k16['memory']['activations'])} GB of activations; 18.5 GB in the record of
2026-12-05, which charged every micro-batch in flight a recomputed block). Kimi K2 fit
in about 30 GB per GPU because its ZeRO-1 spreads the
optimizer states over every data-parallel replica of that 256-GPU group as well, and it
kept bf16 parameters with fp32 gradients. PP 4 x DP 64 x EP 64 (NVIDIA's Kimi K2 run
on GB300, 288 GB per GPU, as issue 52 cites it; no link here) fits in 80 GB here,
{gb(k4['peak_bytes'])} GB: the same states, 4 - k micro-batches in flight
({gb(k4['memory']['activations'])} GB) and a packed window of 1/64 of the experts
({gb(k4['memory']['packed_buffers'])} GB)."""


def _pp1_notes(p1: dict, p4: dict) -> str:
    """Why the pipeline's estimate at PP 1 is `predict`'s, and what it was before (the
    figures of 2026-12-05 written out: they are that record's)."""
    micro = dict(tokens=SEQ_405B, hidden=LLAMA3_405B["dim"], elt=2, checkpointed=True, tp=8)
    logits = SEQ_405B * LLAMA3_405B["vocab_size"] * (2 + 4)  # bf16 and their fp32 copy
    block = activation_bytes(layers=0, vocab=0, **micro)  # one recomputed block
    apart = p1["predict_peak_bytes"] - p1["peak_bytes"]
    return f"""At PP 1 the pipeline's estimate, {gb(p1['peak_bytes'])} GB, is `predict`'s (the
planner's usual pp 1 path, the one checked against measurement), {gb(p1['predict_peak_bytes'])}
GB, within {apart / 1e6:.0f} MB, so that `layout.pp: auto` weighs pp 1 and pp > 1 alike: the
activations are counted alike, {gb(p1['memory']['activations'])} GB (126 layers' block
inputs, one block recomputed, and the logits, 1/8 of them, {gb(logits / 8)} GB: the head
keeps TP's vocabulary shards under loss parallel, in the stages too), and the states
differ only in that the pipeline takes an even share per GPU where `predict` takes the
worst rank of dmuon's partition (and the norms, which TP does not split, whole). The
record of 2026-12-05 read 19.9 GB against 13.8: the pipeline held the whole logits,
{gb(logits)} GB, on every TP rank, and counted a second recomputed block,
{gb(block)} GB, for the head. The same two terms made the head's pp rank PP 4's worst,
16.1 GB then; now pp rank {p4['worst_pp_rank']} is, at {gb(p4['peak_bytes'])} GB."""


def _split_notes(measured: list[dict], cpu: str, total: float,
                 copied: dict | None = None) -> str:
    return f"""**Stage split.** The planner's split (`stage_split.best_split`: the contiguous
split whose slowest pp rank, forward + backward + the optimizer step's NS at its busiest
owner, is least), the split by layer count (`by_count`) and the split that leaves NS
out (`without_ns`), each costed with NS. At must-show 6's shape (8 layers of a
4096-wide model, a 256k head) the head's stage takes one layer and the slowest stage
falls from the by-count split's to the planner's; NS is small beside 8 x 8192 tokens'
compute there, so leaving it out finds the same split. With few tokens per step (32
layers on 4 GPUs, 4 x 512 tokens) NS weighs about as much as the layers' compute: the
split without it gives the head's stage 5 layers and the others 9, their NS then making
them the slowest; with it, 8 each. 405B's layers are all alike: every split's slowest
rank holds ceil(126/pp) layers. The Kimi K2 shape's MoE layers carry the NS of all 384
experts (their forward only top 8): the planner gives the first stage (the embedding
and the dense first layer) 3 layers and the last 2 (with the head), so its slowest pp
rank is 15% faster than by count at PP 16 and 4% at PP 4; the split without NS is the
same one, the MoE layers being alike.

**Measured** on this machine ({cpu}, 2 cores shared, 4 gloo ranks over loopback,
OMP 1 thread each), fp32 with NS in fp32: `bench.pp_measure`'s built-in `small` model
({GLOBAL_ROWS_MEASURED} x 64 tokens per step, 4 micro-batches of 2 rows per pipeline).
The pp bytes are the activations (forward, pp rank 0) and their gradients (backward, pp
rank 1), m x rows x seq x 256 x 4 bytes = 524.3 KB, as the planner's formula says, and
the optimizer step's agreement (12 bytes); the shard bytes fall to a third: each
stage's 2 ranks gather and reduce only their stage's half of the model, in groups of 2
instead of 4. The bubble measured is 1 - (the time in the
stage's own forward and backward chunks) / (the schedule's time), each rank's median
step: with 4 ranks on 2 cores shared with other work the stages also wait for a core,
so it mostly reads above the predicted (pp-1)/(m+pp-1), and it and the step times move
between runs (pp rank 0 read 0.26 to 0.34 over five runs on 2026-12-05; one run
recorded). {_timing(total, copied)}"""


def _timing(total: float, copied: dict | None) -> str:
    if copied is None:
        return f"{total:.0f} s for the whole bench."
    return (f"The measured table is copied from {copied['record']} (measured on "
            f"{copied['date']}, {copied['seconds']} s for that whole bench), not re-run; "
            f"every row of the planner's three tables above was recomputed on this date "
            f"({total:.0f} s).")


def notes(llama, kimi, splits, measured, cpu, total, copied=None) -> str:
    return _planner_notes(llama, kimi) + "\n\n" + (_split_notes(measured, cpu, total, copied)
                                                    if measured else "")


if __name__ == "__main__":
    main()
