"""The reference's bucketed clipping and Muon-only clip strategies on 4 gloo ranks: each
clip coefficient and statistic equals a float64 computation of the formula
``dmuon/clip_buckets.py`` documents (norm over the group, ``min(1, max_norm / (norm +
1e-6))``, 1 for a non-finite norm or ``max_norm=None``)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.model import build_model, get_config, muon_predicate
from helpers.train import build_dmuon, global_batches, local_rows, loss_of
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

WORLD, MAX_NORM, SMALL_MAX = 4, 1.0, 1e-3


def _grads(rank: int) -> dict:
    """Each bucket's gradients on ``rank``, drawn from seeds (rebuilt by the test)."""
    def randn(seed, *shape, dtype=torch.float64, scale=1.0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g, dtype=torch.float64).mul(scale).to(dtype)

    inf = torch.zeros(3, dtype=torch.float64)
    if rank == 2:
        inf[1] = math.inf
    return {
        "big": ([randn(10 * rank + 1, 5, 7), randn(10 * rank + 2, 11)], {}),
        "fp32": ([randn(10 * rank + 3, 6, 6, dtype=torch.float32, scale=3.0)], {}),
        "small": ([randn(10 * rank + 4, 4, scale=1e-3)], {}),
        "inf": ([inf, randn(10 * rank + 5, 3)], {}),
        "linf": ([randn(10 * rank + 6, 9, scale=4.0)], {"norm_type": math.inf}),
        "l1": ([randn(10 * rank + 7, 9, scale=0.1)], {"norm_type": 1.0}),
        "replicated": ([randn(99, 8)], {"replicas": WORLD}),  # the same on every rank
    }


def _buckets(rank):
    return [dmuon.GradClipBucket(name, [g.clone() for g in grads], **kw)
            for name, (grads, kw) in _grads(rank).items()]


def _stats(result):
    return {s.name: (s.total_norm.item(), s.clip_coef.item(), bool(s.clipped),
                     bool(s.found_inf)) for s in result.buckets}


def _model_part(rank, world):
    """Wall-X's three buckets and the Muon-only strategies on a dedicated model."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model, opt = build_dmuon(mesh, True)
    tokens = local_rows(global_batches(1)[0], rank, world)
    out = {}

    def backward():
        opt.zero_grad()
        loss_of(model, tokens).backward()

    backward()
    regular = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    out["wallx"] = _stats(dmuon.try_clip_optimizer_grad_norm_buckets_(
        opt, regular_grads=regular, adamw_grads=[], max_norm=SMALL_MAX))
    backward()
    stats = dmuon.clip_grad_norm_(opt, SMALL_MAX, strategy="global_norm")
    assert isinstance(stats, dmuon.MuonGradClipStats)
    out["global"] = (stats.total_norm.item(), stats.clip_coef.item(), bool(stats.clipped))
    out["after"] = dmuon.clip_grad_norm_(opt, None, strategy="global_norm").total_norm.item()
    backward()  # the reference's method form, its default strategy
    assert opt.last_muon_grad_clip_stats() is None
    method = opt.clip_grad_norm_(SMALL_MAX)
    assert opt.last_muon_grad_clip_stats() is method
    out["method"] = (method.total_norm.item(), method.clip_coef.item(), method.strategy)

    def halve(grads, max_norm, *, norm_type, all_reduce):
        for g in grads:
            g.mul_(0.5)
        one = torch.ones((), dtype=torch.float64)
        return dmuon.MuonGradClipStats(one, one * 0.5, one > 0, one < 0, max_norm, "halve",
                                       len(grads))

    dmuon.register_muon_grad_clip_strategy("halve", halve)
    backward()
    dmuon.clip_grad_norm_(model, 1.0, strategy="halve")
    out["halved"] = dmuon.clip_grad_norm_(opt, None, strategy="global_norm").total_norm.item()
    return out


def _worker(rank, world):
    buckets = _buckets(rank)
    result = dmuon.clip_grad_norm_buckets_(buckets, MAX_NORM, chunk_size=1024)
    untouched = _buckets(rank)
    stats_only = dmuon.clip_grad_norm_buckets_(untouched, None)
    return {"stats": _stats(result), "clipped": {b.name: b.grads for b in buckets},
            "stats_only": _stats(stats_only),
            "stats_only_grads": {b.name: b.grads for b in untouched},
            **_model_part(rank, world)}


@functools.cache
def _runs():
    return run(_worker, world_size=WORLD)


def _expected(name, max_norm):
    """float64: the bucket's norm over all ranks, its coefficient, the two flags."""
    grads_by_rank = [_grads(r)[name] for r in range(WORLD)]
    kw = grads_by_rank[0][1]
    p = kw.get("norm_type", 2.0)
    flat = torch.cat([g.double().reshape(-1) for grads, _ in grads_by_rank for g in grads])
    if kw.get("replicas"):
        flat = torch.cat([g.double().reshape(-1) for g in grads_by_rank[0][0]])
    norm = flat.abs().max().item() if math.isinf(p) else flat.abs().pow(p).sum().item() ** (1 / p)
    finite = math.isfinite(norm)
    coef = 1.0 if max_norm is None or not finite else min(1.0, max_norm / (norm + 1e-6))
    return norm, coef, coef < 1, not finite


def _close(a, b, rel=1e-12):
    return a == b or (math.isfinite(a) and abs(a - b) <= rel * abs(b))


def test_each_bucket_follows_the_formula():
    for rank, res in enumerate(_runs()):
        for name, (grads, _) in _grads(rank).items():
            for stats, max_norm in ((res["stats"], MAX_NORM), (res["stats_only"], None)):
                norm, coef, clipped, found_inf = stats[name]
                e_norm, e_coef, e_clipped, e_inf = _expected(name, max_norm)
                rel = 1e-6 if name == "fp32" else 1e-12
                assert _close(norm, e_norm, rel) and _close(coef, e_coef, rel), (rank, name)
                assert (clipped, found_inf) == (e_clipped, e_inf), (rank, name)
            e_coef = _expected(name, MAX_NORM)[1]
            for got, g in zip(res["clipped"][name], grads):
                expected = (g.double() * e_coef).to(g.dtype)
                assert torch.allclose(got, expected, rtol=1e-6 if name == "fp32" else 1e-12,
                                      atol=0, equal_nan=True), (rank, name)
            for got, g in zip(res["stats_only_grads"][name], grads):
                assert torch.equal(got, g), (rank, name)
    flags = {n: _runs()[0]["stats"][n][2:] for n in ("big", "small", "inf")}
    assert flags == {"big": (True, False), "small": (False, False), "inf": (False, True)}


@functools.cache
def _reference_norms():
    """float64, one process, the whole batch: the Muon matrices' gradient norm and the
    rest's."""
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    loss_of(model, global_batches(1)[0]).backward()
    sq = {True: 0.0, False: 0.0}
    for n, p in model.named_parameters():
        sq[muon_predicate(n, p)] += p.grad.pow(2).sum().item()
    return math.sqrt(sq[True]), math.sqrt(sq[False])


def test_wall_x_buckets_and_muon_strategies_match_one_process():
    muon, regular = _reference_norms()
    coef = lambda n: min(1.0, SMALL_MAX / (n + 1e-6))  # noqa: E731
    for rank, res in enumerate(_runs()):
        wallx = res["wallx"]
        assert _close(wallx["muon"][0], muon, 1e-9) and _close(wallx["muon"][1], coef(muon),
                                                                1e-9), rank
        assert _close(wallx["regular"][0], regular, 1e-9), rank
        assert wallx["adamw"][:2] == (0.0, 1.0)  # no AdamW route in this model
        norm, c, clipped = res["global"]
        assert _close(norm, muon, 1e-9) and _close(c, coef(muon), 1e-9) and clipped
        assert res["after"] == pytest.approx(muon * coef(muon), rel=1e-9)
        assert res["method"][:2] == (norm, c) and res["method"][2] == "global_norm"
        assert res["halved"] == pytest.approx(muon / 2, rel=1e-9)


def test_strategy_refusals():
    with pytest.raises(ValueError, match="built-in"):
        dmuon.register_muon_grad_clip_strategy("global_norm", lambda *a, **k: None)
    with pytest.raises(TypeError, match="callable"):
        dmuon.register_muon_grad_clip_strategy("x", 3)
    with pytest.raises(ValueError, match="repeat"):
        dmuon.clip_grad_norm_buckets_([dmuon.GradClipBucket("a", []),
                                       dmuon.GradClipBucket("a", [])], 1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        dmuon.clip_grad_norm_buckets_([], 1.0, chunk_size=0)
