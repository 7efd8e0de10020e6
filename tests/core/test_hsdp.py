"""HSDP on a 2x2 (replicate x shard) mesh of 4 gloo processes."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.train import (
    build_model,
    get_config,
    gram_ns_flops,
    hsdp_train,
    muon_predicate,
    reference_run,
)

import dmuon
from dmuon.testing import run

STEPS, WORLD, ELT = 10, 4, 8


@functools.cache
def hsdp(z3=True, replicate_async=True, micro=1, clip=None, steps=STEPS, layout=(2, 2),
         accumulate="no_sync"):
    return run(hsdp_train, layout, z3=z3, steps=steps, replicate_async=replicate_async,
               micro=micro, clip=clip, accumulate=accumulate,
               world_size=layout[0] * layout[1])


@functools.cache
def reference(steps=STEPS):
    return reference_run(steps)


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("z3", [False, True], ids=["z2", "z3"])
def test_hsdp_matches_float64_reference(z3):
    ref, _ = reference()
    for rank, res in enumerate(hsdp(z3=z3)):
        for key, value in ref.items():
            assert _rel_err(res["final"][key], value) <= 1e-9, (rank, key)


def test_async_and_sync_replicate_broadcast_are_bit_identical():
    a, s = hsdp(replicate_async=True), hsdp(replicate_async=False)
    for rank in range(WORLD):
        assert a[rank]["losses"] == s[rank]["losses"]
        for key, value in a[rank]["final"].items():
            assert torch.equal(value, s[rank]["final"][key]), (rank, key)


def test_replicate_bytes_per_column_and_one_ns_per_matrix():
    R, N = 2, 2
    plan = dmuon.partition(build_model(get_config("tiny"), device="meta"),
                           predicate=muon_predicate, shard_size=N, replicate_size=R)
    column = [0] * N
    for a in plan.params.values():
        column[a.owner_coord[1]] += a.numel
    p_m = plan.total_elements
    for rank, res in enumerate(hsdp()):
        s = rank % N
        ledger = res["ledger"]
        replicate = ledger["replicate"]["reduce"] + ledger["replicate"]["replicate"]
        assert replicate == 2 * (R - 1) * column[s] * ELT / R
        shard = {p: ledger["shard"][p] for p in ("forward", "backward", "reduce")}
        assert sum(shard.values()) == 3 * (N - 1) * p_m * ELT / N
        # one fp32 all-reduce per dim of flags: which units got a gradient anywhere,
        # which ranks' gradients were not finite (one per rank, one for FSDP2's); then,
        # after NS, one more all-reduce of one flag (an update not finite)
        flags = len(plan.params) + R * N + 1 + 1
        assert ledger["shard"]["step"] == 2 * (N - 1) * flags * 4 / N
        assert ledger["replicate"]["step"] == 2 * (R - 1) * flags * 4 / R
    # NS once per matrix over all R x N ranks: every matrix has exactly one owner slot
    owners = [a.owner for a in plan.params.values()]
    assert sorted(set(owners)) == list(range(R * N))


def _ns_flops_worker(rank, world):
    from helpers.train import build_dmuon, global_batches, local_rows, loss_of
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.flop_counter import FlopCounterMode

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = build_dmuon(mesh["shard"], True, replicate_mesh=mesh["replicate"],
                             fsdp_mesh=mesh)
    loss_of(model, local_rows(global_batches(1)[0], rank, world)).backward()
    with FlopCounterMode(display=False) as counter:
        opt.step()
    return counter.get_total_flops()


def test_newton_schulz_flops_once_per_matrix_across_replicas():
    shapes = [tuple(p.shape) for n, p in build_model(get_config("tiny"), device="meta")
              .named_parameters() if muon_predicate(n, p)]
    expected = sum(gram_ns_flops(s) for s in shapes)
    assert sum(run(_ns_flops_worker, world_size=WORLD)) == expected


def test_clipped_norm_equals_single_process_norm():
    clip = 0.5
    ref_norms = _reference_norms(clip, steps=3)
    for res in hsdp(clip=clip, steps=3):
        assert res["norms"] == pytest.approx(ref_norms, rel=1e-9)


def _reference_norms(clip, steps):
    """Single process: the global-batch gradient norm at each step, clipping applied."""
    from helpers.train import global_batches, loss_of, lr_lambda, reference_ns, reference_optimizers

    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    opts = reference_optimizers([p for n, p in model.named_parameters() if muon_predicate(n, p)],
                                [p for n, p in model.named_parameters()
                                 if not muon_predicate(n, p)])
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in opts]
    norms = []
    with reference_ns():
        for batch in global_batches(steps):
            loss_of(model, batch).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
            for o in opts:
                o.step()
                o.zero_grad()
            for s in scheds:
                s.step()
    return norms
