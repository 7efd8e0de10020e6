"""The reference's Newton-Schulz objects (``dmuon.NewtonSchulz``, ``gram_newton_schulz``,
``get_ns_backend``, ``get_backend_status``): against an independent float64 iteration,
and ``Muon(ns_backend=NewtonSchulz(...))`` on 4 gloo ranks against torch.optim.Muon."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.train import build_dmuon, global_batches, local_rows, loss_of, lr_lambda, reference_run
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

STEPS = 10


def _standard_fp64(G, schedule):
    """The quintic iteration X <- aX + (bA + cA²)X, A = XXᵀ, with one (a, b, c) per
    iteration, in float64 on the wide orientation."""
    x = G.to(torch.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for a, b, c in schedule:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def _matrix(rows=24, cols=40, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
@pytest.mark.parametrize("backend", ["gram", "direct"])
@pytest.mark.parametrize("restart", [None, [2], []])
def test_newton_schulz_object_runs_its_schedule(backend, restart, shape):
    G = _matrix(*shape)
    for coefficients in (None, dmuon.YOU_COEFFICIENTS):
        ns = dmuon.NewtonSchulz(backend, coefficients=coefficients, restart_iterations=restart)
        expected = _standard_fp64(G, coefficients or dmuon.POLAR_EXPRESS_COEFFICIENTS)
        out = ns.local(G, steps=99)  # the reference ignores steps: its coefficients count
        assert out.dtype == torch.float64
        assert _rel(out, expected) < 1e-10, (backend, restart, shape)


def test_gram_newton_schulz_keeps_the_input_dtype():
    G = _matrix().float()
    out = dmuon.gram_newton_schulz(G, coefficients=dmuon.YOU_COEFFICIENTS)
    assert out.dtype == torch.float32 and out.shape == G.shape
    assert _rel(out.double(), _standard_fp64(G, dmuon.YOU_COEFFICIENTS)) < 1e-4
    assert torch.equal(dmuon.gram_newton_schulz(G, deterministic=True),
                       dmuon.NewtonSchulz("gram").local(G))


@pytest.mark.parametrize("kwargs,match", [
    ({"kernel": "quack"}, "not available"), ({"kernel": "cute_sm80"}, "not available"),
    ({"kernel": "triton"}, "not one of"), ({"backend": "svd"}, "not one of"),
    ({"restart_iterations": [3]}, r"restarts at iteration 2"),
    ({"coefficients": [(1.0, 2.0)]}, "3 values"),
])
def test_refusals_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dmuon.NewtonSchulz(**kwargs)


def test_kernel_reports():
    status = dmuon.get_backend_status()
    assert set(status) >= {"sm_version", "auto_choice", "quack_available",
                           "cute_sm80_available", "cublas_always_available"}
    assert status["quack_available"] is status["cute_sm80_available"] is False
    line = dmuon.get_ns_backend()
    assert line.startswith(f"Gram NS · kernel={status['auto_choice']} (SM{status['sm_version']},")
    assert dmuon.NewtonSchulz(kernel="cublas").kernel == dmuon.NewtonSchulz().kernel


def _train_with_object(rank, world):
    """The reference's example: ns = NewtonSchulz("direct", coefficients=YOU_COEFFICIENTS);
    Muon(model, ns_backend=ns)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    ns = dmuon.NewtonSchulz("direct", coefficients=dmuon.YOU_COEFFICIENTS)
    model, opt = build_dmuon(mesh, True, ns_backend=ns)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for batch in global_batches(STEPS):
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    groups = [(g["ns_backend"], g["ns_steps"], g.get("ns_restart"))
              for g in opt.param_groups if g["kind"] == "muon"]
    return {"full": dmuon.full_state_dict(model), "groups": groups}


@functools.cache
def _runs():
    return run(_train_with_object, world_size=4)


def test_muon_takes_a_newton_schulz_object():
    ref, _ = reference_run(STEPS, ns=lambda g, *_: _standard_fp64(g, dmuon.YOU_COEFFICIENTS))
    for rank, res in enumerate(_runs()):
        assert res["groups"] == [("standard", 5, True)]
        for key, value in ref.items():
            assert _rel(res["full"][key], value) <= 1e-9, (rank, key)
