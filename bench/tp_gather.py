"""Gathering a TP-split matrix that FSDP2 also shards, as an export does: DTensor's
``full_tensor()`` of the head's weight on a (shard, tp) mesh, placements
``(_StridedShard(0), Shard(0))``, which DTensor does as two all-gathers (over ``shard``,
then over ``tp``, logging "2 sequential all_gather operations ... suboptimal"), against
the one all-gather of the same bytes over all ranks that a merged gather would need (it
would still have to reorder the rows: FSDP2's shards are slices of the TP shards).

Each rank receives (N T - 1) / (N T) of the matrix either way; the two-step gather pays
one more collective's latency, once per such matrix per export.

``python -m bench.tp_gather``: 4 gloo ranks (1 x 2 x 2), prints the table and writes the
dated record ``bench/results/tp_gather_<machine>_<date>.{md,json}``."""

from __future__ import annotations

import statistics
import time

import torch

SHAPES = [(4096, 256), (16384, 512), (32768, 1024)]  # (vocabulary, hidden), float32
REPEATS = 15


def _times(fns) -> list[float]:
    """Median seconds of each of ``fns`` over ``REPEATS`` rounds (after one warm-up),
    taken in turn within a round so that a busy machine slows them alike; ranks aligned."""
    import torch.distributed as dist

    samples = [[] for _ in fns]
    for round_ in range(REPEATS + 1):
        for fn, times in zip(fns, samples):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if round_:
                times.append(time.perf_counter() - t0)
    return [statistics.median(times) for times in samples]


@torch.no_grad()
def _measure(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    return [_gather_times(mesh, vocab, hidden, world) for vocab, hidden in SHAPES]


def _gather_times(mesh, vocab: int, hidden: int, world: int) -> dict:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    head = nn.Linear(hidden, vocab, bias=False)
    parallelize_module(head, mesh["tp"], ColwiseParallel())
    fully_shard(head, mesh=mesh["shard"])
    weight = head.weight
    full = weight.full_tensor()
    local = weight.to_local().detach().clone()
    out = torch.empty(world * local.numel(), dtype=local.dtype)

    def one():
        dist.all_gather_single(out, local.reshape(-1))

    def merged():  # ranks are shard-major: rank s x T + t holds rows of TP shard t
        one()
        return out.view(2, 2, *local.shape).transpose(0, 1).reshape(vocab, hidden)

    assert torch.equal(merged(), full)
    two, single, reordered = _times([weight.full_tensor, one, merged])
    return {"shape": [vocab, hidden], "placements": str(weight.placements),
            "mb": full.numel() * full.element_size() / 1e6, "two_all_gathers_ms": two * 1e3,
            "one_all_gather_ms": single * 1e3, "one_all_gather_reordered_ms": reordered * 1e3}


def main() -> None:
    from bench._record import write_record
    from dmuon.testing import run

    rows = run(_measure, world_size=4)[0]
    lines = ["| matrix (float32) | MB | full_tensor(): 2 all-gathers, ms | 1 all-gather "
             "of the same bytes, ms | 1 all-gather + reorder, ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape'][0]} x {r['shape'][1]} | {r['mb']:.1f} | "
              f"{r['two_all_gathers_ms']:.1f} | {r['one_all_gather_ms']:.1f} | "
              f"{r['one_all_gather_reordered_ms']:.1f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    write_record("tp_gather", "A TP-split, FSDP2-sharded matrix gathered in full on "
                 "1 x 2 x 2 gloo ranks", table, {"rows": rows},
                 notes=f"Placements {rows[0]['placements']}; median of {REPEATS}.")


if __name__ == "__main__":
    main()
