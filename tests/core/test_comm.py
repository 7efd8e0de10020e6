"""dmuon.comm's one-launch forms (what runs under NCCL) on 4 gloo processes, where gloo
has them: segments of equal size take the into-tensor all-gather and reduce-scatter, one
collective each, in place where the segment is a view of the output, with the same
results as the point collectives gloo otherwise runs. (Uneven one-launch forms need
NCCL's coalescing; gloo refuses them.)"""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers.collectives import CollectiveRecorder

from dmuon import comm
from dmuon.testing import run

WORLD, SEG = 4, 3


def _expected_gather() -> list[float]:
    return [float(r + 1) for r in range(WORLD) for _ in range(SEG)]


def _expected_reduced(rank: int) -> list[float]:
    # rank r contributes arange * (r + 1); the sum over ranks is arange * 10
    return [10.0 * i for i in range(rank * SEG, (rank + 1) * SEG)]


def _exercise(rank: int, group) -> dict:
    ledger, sizes = comm.Ledger(), [SEG] * WORLD
    out = torch.zeros(WORLD * SEG, dtype=torch.float64)
    mine = torch.full((SEG,), rank + 1.0, dtype=torch.float64)
    comm.wait(comm.all_gather_v(out, sizes, mine, group, ledger, "shard", "forward"))
    in_place = torch.zeros(WORLD * SEG, dtype=torch.float64)
    own = in_place[rank * SEG:(rank + 1) * SEG]
    own.fill_(rank + 1.0)
    comm.wait(comm.all_gather_v(in_place, sizes, own, group, ledger, "replicate",
                                "replicate"))
    full = torch.arange(WORLD * SEG, dtype=torch.float64) * (rank + 1)
    reduced = torch.empty(SEG, dtype=torch.float64)
    comm.wait(comm.reduce_scatter_v(reduced, full, sizes, group, ledger, "shard", "reduce"))
    return {"gathered": out.tolist(), "in_place": in_place.tolist(),
            "reduced": reduced.tolist(), "ledger": ledger.current()}


def _both_forms(rank, world):
    group = dist.group.WORLD
    with CollectiveRecorder() as rec:
        points = _exercise(rank, group)
        point_ops = [c.op for c in rec.take()]
        comm.one_launch = lambda tensor: True  # NCCL's branch, on gloo (this process only)
        launched = _exercise(rank, group)
        launched_ops = [c.op for c in rec.take()]
    return {"points": points, "point_ops": point_ops, "launched": launched,
            "launched_ops": launched_ops}


def test_equal_segments_take_one_into_tensor_collective_each():
    results = run(_both_forms, world_size=WORLD)
    for rank, r in enumerate(results):
        for form in ("points", "launched"):
            assert r[form]["gathered"] == _expected_gather(), (rank, form)
            assert r[form]["in_place"] == _expected_gather(), (rank, form)
            assert r[form]["reduced"] == _expected_reduced(rank), (rank, form)
        assert r["launched"]["ledger"] == r["points"]["ledger"]
        assert r["launched_ops"] == ["all_gather_into_tensor", "all_gather_into_tensor",
                                     "reduce_scatter_tensor"]
        assert r["point_ops"] == ["broadcast"] * 2 * WORLD + ["reduce"] * WORLD
