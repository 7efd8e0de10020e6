"""Training quality of Gram NS against standard NS, as Gram NS's authors judge it: the
built-in ``small`` model trained 300 steps on the built-in corpus (the standard
library's sources, bytes) with ``dmuon.Muon``, 3 seeds, for quintic and Polar Express
coefficients; the mean final validation loss of Gram must lie within 0.01 nats of
standard's. NS in fp32 (the CPU default). Runs two trainings at a time, one thread each.
Prints a table and writes bench/results/ns_quality.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from concurrent.futures import ProcessPoolExecutor

RESULTS = pathlib.Path(__file__).parent / "results"
CONFIGS = [(b, c) for c in ("quintic", "polar_express") for b in ("standard", "gram")]


def _lr(step: int, steps: int, warmup: int = 20) -> float:
    """Linear warm-up, then linear decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    return 1.0 - 0.9 * (step - warmup) / max(1, steps - warmup)


def _process_group() -> None:
    """A one-rank gloo group for this worker process (once)."""
    import torch.distributed as dist

    from service.control.ray_head import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{free_port()}")


def train(backend: str, coefficients: str, seed: int, steps: int, batch: int, seq: int) -> float:
    """One training on one rank; returns the final validation loss."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.job.models.builtin import build_model, causal_lm_loss
    from service.job.models.params import split_params
    from service.worker.corpus import batch_at, load_corpus

    torch.set_num_threads(1)
    _process_group()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    model = build_model("small", seed=seed)
    dmuon.dedicate_params(model, mesh, predicate=split_params(model).predicate)
    dmuon.fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=3e-3, ns_backend=backend,
                     ns_coefficients=coefficients)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr(s, steps))
    train_data, val_data = load_corpus("train"), load_corpus("val")
    for step in range(steps):
        tokens = batch_at(train_data, step, batch, seq, seed=seed)
        causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    with torch.no_grad():
        losses = [causal_lm_loss(model(t[:, :-1]), t[:, 1:]).item()
                  for t in (batch_at(val_data, i, batch, seq, seed=1000) for i in range(16))]
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=2)
    args = ap.parse_args()
    jobs = [(b, c, s) for b, c in CONFIGS for s in range(args.seeds)]
    with ProcessPoolExecutor(args.parallel) as pool:
        futures = {job: pool.submit(train, *job, args.steps, args.batch, args.seq)
                   for job in jobs}
        losses = {job: f.result() for job, f in futures.items()}
    rows = []
    print(f"\n'small', {args.steps} steps of {args.batch} x {args.seq} tokens, "
          f"{args.seeds} seeds, NS fp32: final validation loss (nats)")
    print("| coefficients | backend | mean | std | per seed | gram - standard |\n"
          "|---|---|---:|---:|---|---:|")
    for b, c in CONFIGS:
        values = [losses[(b, c, s)] for s in range(args.seeds)]
        mean = statistics.mean(values)
        std_mean = statistics.mean(losses[("standard", c, s)] for s in range(args.seeds))
        diff = f"{mean - std_mean:+.4f}" if b == "gram" else "-"
        print(f"| {c} | {b} | {mean:.4f} | {statistics.pstdev(values):.4f} |"
              f" {', '.join(f'{v:.4f}' for v in values)} | {diff} |")
        rows.append({"backend": b, "coefficients": c, "losses": values, "mean": mean})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ns_quality.json").write_text(json.dumps({"args": vars(args), "rows": rows},
                                                        indent=2))


if __name__ == "__main__":
    main()
