"""Expert parallelism measured on this machine: the built-in MoE (``small-moe``: 2
layers, 8 experts, top 2, hidden 128) on 4 gloo ranks as 1 x 4 with the experts whole
(EP 1) and split over EP 2 (EP 2 x expert shard 2), built by the workers' own code
(``service.worker.loop.build_training``), fp32 (NS in fp32: CPUs here differ widely in
bf16 matmul speed), Z3, 8 rows of 64 tokens per rank. Per layout: the bytes per step by
mesh dim as the ledger counts them (the median rank), the planner's prediction beside
them, and the median step time over the timed steps (after warm-up steps).

``python -m bench.ep_run``: prints the table and writes the dated record
``bench/results/ep_run_<machine>_<date>.{md,json}``."""

from __future__ import annotations

import statistics
import time

import torch

from bench._record import write_record
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.predict import predict
from service.job.spec import parse_spec

WARMUP, TIMED, ROWS, SEQ = 3, 10, 8, 64
LAYOUTS = {"EP 1": {"replicate": 1, "shard": 4}, "EP 2": {"replicate": 1, "shard": 4, "ep": 2}}


def _spec(layout: dict) -> dict:
    return {"model": "small-moe", "precision": "float32", "dmuon": {"mode": "z3"},
            "optimizer": {"ns_dtype": "float32"}, "layout": layout, "batch_size": ROWS,
            "seq_len": SEQ, "clip_grad_norm": 1.0}


def _measure(rank, world, data):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.job.models.build import logits_of
    from service.job.models.builtin import causal_lm_loss
    from service.worker.corpus import batch_at, load_corpus
    from service.worker.loop import build_training

    torch.set_num_threads(1)
    spec = parse_spec(data)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model, opt, _ = build_training(spec, mesh)
    corpus = load_corpus("train", max_bytes=2_000_000)
    times = []
    for step in range(WARMUP + TIMED):
        rows = batch_at(corpus, step, ROWS * world, SEQ)[rank * ROWS:(rank + 1) * ROWS]
        torch.distributed.barrier()
        start = time.perf_counter()
        causal_lm_loss(logits_of(model, rows[:, :-1]), rows[:, 1:]).backward()
        dmuon.clip_grad_norm_(model, spec.clip_grad_norm)
        opt.step()
        opt.zero_grad()
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    ledger = dmuon.get_ledger(model).last_step_by_phase()
    return {"bytes": {dim: sum(phases.values()) for dim, phases in ledger.items()},
            "step_s": statistics.median(times[WARMUP:])}


def _row(name: str, results: list[dict], predicted) -> dict:
    dims = ("shard", "ep")
    measured = {d: statistics.median(r["bytes"].get(d, 0) for r in results) for d in dims}
    planned = {d: statistics.median(sum(p.ledger.get(d, {}).values())
                                    for p in predicted.ranks) for d in dims}
    return {"layout": name, "measured_bytes": measured, "predicted_bytes": planned,
            "step_s": statistics.median(r["step_s"] for r in results)}


def main() -> None:
    from dmuon.testing import run

    rows = []
    for name, layout in LAYOUTS.items():
        data = _spec(layout)
        predicted = predict(parse_spec(data), synthetic_inventory(1, 0, cpus_per_node=4))
        rows.append(_row(name, run(_measure, data, world_size=4), predicted))
    lines = ["| layout | shard KB/step (measured / planned) | ep KB/step (measured / planned) "
             "| step s (median) |", "|---|---:|---:|---:|"]
    for r in rows:
        m, p = r["measured_bytes"], r["predicted_bytes"]
        lines.append(f"| {r['layout']} | {m['shard'] / 1e3:,.1f} / {p['shard'] / 1e3:,.1f} "
                     f"| {m['ep'] / 1e3:,.1f} / {p['ep'] / 1e3:,.1f} | {r['step_s']:.3f} |")
    table = "\n".join(lines)
    print(table)
    print(write_record("ep_run", "Expert parallelism measured: small-moe on 4 gloo ranks, "
                       "EP 1 against EP 2", table, {"rows": rows}, notes=__doc__.split(
                           "\n\n")[0].replace("\n", " ")))


if __name__ == "__main__":
    main()
