"""Host syncs (``helpers.syncs.SyncCounter``: what would drain the stream on CUDA) of
``dmuon.dispatch_combine`` and of the core's optimizer step, counted on the CPU.

A dispatch reads its row counts on the host once (the splits of its all-to-alls and the
experts' groups come from them); everything else stays on the device. EP 2 on 2 gloo
ranks and EP 1 in one process (``group=None``: no collective), float64, against a dense
per-expert loop for the outputs. The core step's count is pinned to what it was before
the dispatch changed (measured on main 3b1d3f1, the tiny model, Z3 on 2 ranks), so a new
sync there shows: the presence list and the "any rank" flag, the two device reads of
the step, and AdamW's 7 reads of its step counters (CPU scalars in torch's AdamW, so
host reads on CUDA too, counted here as the CPU cannot tell them apart)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.syncs import SyncCounter
from helpers.train import build_dmuon, global_batches, local_rows, loss_of

from dmuon.expert_dispatch import dispatch_combine, grouped_linear
from dmuon.testing import run

D, H, E, K, N = 16, 24, 8, 2, 12
# dmuon.Muon.step(), Z3 on 2 ranks, as main 3b1d3f1 counts it
CORE_STEP_SYNCS = {"tolist": 1, "_local_scalar_dense": 1 + 7}


def _weights(count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    up = torch.randn(count, H, D, generator=g, dtype=torch.float64) * 0.3
    down = torch.randn(count, D, H, generator=g, dtype=torch.float64) * 0.3
    return up, down


def _grouped(up, down):
    """Experts called once with all their rows grouped (``dispatch_combine``'s form)."""
    return lambda rows, groups: grouped_linear(
        F.silu(grouped_linear(rows, up, groups)), down, groups)


def _inputs(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    weights, choices = torch.randn(N, E, generator=g, dtype=torch.float64).softmax(-1).topk(K)
    return x, choices, weights


def _dense(x, choices, weights, up, down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(choices[t, j])
            out[t] += weights[t, j] * (F.silu(x[t] @ up[e].T) @ down[e].T)
    return out


def _dispatch_worker(rank, world):
    up, down = _weights(E)
    per = E // world
    experts = _grouped(up[rank * per:(rank + 1) * per], down[rank * per:(rank + 1) * per])
    x, choices, weights = _inputs(rank)
    with SyncCounter() as syncs:
        out = dispatch_combine(x, choices, weights, experts, E, dist.group.WORLD)
    return {"syncs": dict(syncs.by_kind),
            "err": (out - _dense(x, choices, weights, up, down)).abs().max().item()}


def test_a_dispatch_over_ep2_syncs_the_host_once():
    for rank, res in enumerate(run(_dispatch_worker, world_size=2)):
        assert sum(res["syncs"].values()) <= 1, (rank, res["syncs"])
        assert res["err"] <= 1e-12, rank


def test_a_local_dispatch_syncs_the_host_once():
    up, down = _weights(E)
    x, choices, weights = _inputs(0)
    with SyncCounter() as syncs:
        out = dispatch_combine(x, choices, weights, _grouped(up, down), E, None)
    assert syncs.total <= 1, syncs.by_kind
    assert (out - _dense(x, choices, weights, up, down)).abs().max() <= 1e-12


def test_bad_expert_ids_are_refused_with_a_clear_error():
    up, down = _weights(E)
    x, choices, weights = _inputs(0)
    for bad in (-1, E):
        wrong = choices.clone()
        wrong[3, 1] = bad
        with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
            dispatch_combine(x, wrong, weights, _grouped(up, down), E, None)


def test_the_sync_counter_sees_the_syncs_it_names():
    """The counter can fail: each form of host read below is counted."""
    t = torch.tensor([1, 2, 2, 0])
    with SyncCounter() as syncs:
        int(t.max())
        t.tolist()
        t.nonzero()
        torch.bincount(t)
        t.repeat_interleave(t)
        t[t > 0]
    assert dict(syncs.by_kind) == {"_local_scalar_dense": 1, "tolist": 1, "nonzero": 1,
                                   "bincount": 2, "repeat_interleave": 1, "bool_index": 1}


def _step_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model, opt = build_dmuon(mesh, z3=True)
    counts = []
    for batch in global_batches(2):
        loss_of(model, local_rows(batch, rank, world)).backward()
        with SyncCounter() as syncs:
            opt.step()
        opt.zero_grad()
        counts.append(dict(syncs.by_kind))
    return counts


def test_the_core_step_keeps_its_host_syncs():
    for rank, counts in enumerate(run(_step_worker, world_size=2)):
        assert counts == [CORE_STEP_SYNCS] * 2, (rank, counts)
