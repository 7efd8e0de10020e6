"""Mixed precision as FSDP2 users write it: bf16 params and compute, reduce in
``reduce_dtype``, fp32 masters and momentum, on 4 gloo processes against a single-process
reference that applies the same policy to each rank's micro-batch.

Tolerance. Each rank's bf16 forward and backward is the reference's computation on the
same micro-batch, kernel for kernel, and every other operation is the same arithmetic on
the same values, except one: the sum of the 4 ranks' gradients, whose order the
collective chooses. bf16 values summed in fp32 are exact only while one element's values
lie within about 2^14 of each other; when they do not, the order moves the last fp32 bit,
and bf16 training amplifies that bit step after step. Measured on the reference alone:
two summation orders end 1.2e-2 to 3.1e-2 apart (largest relative entry) after 10 steps.
So the exact check runs the policy with ``reduce_dtype=float64``, where 4 bf16 values
always sum exactly, and must be bitwise equal; with ``reduce_dtype=float32`` (what users
run) the bound is 0.1, about 3x the reference's own spread over summation orders.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers.collectives import CollectiveRecorder
from helpers.model import build_model, get_config, muon_predicate
from helpers.train import (
    HPARAMS,
    global_batches,
    local_rows,
    loss_of,
    reference_ns,
    reference_optimizers,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import dmuon
from dmuon import cost
from dmuon.testing import run

STEPS, WORLD = 10, 4
MUON = dict(HPARAMS, ns_backend="standard", ns_dtype=torch.float32)
FP32_REDUCE_TOL = 0.1
LAYOUTS = [((1, 4), False), ((1, 4), True), ((2, 2), True)]
IDS = ["z2", "z3", "hsdp2x2"]


def _policy(reduce_dtype, autocast=False):
    """bf16 params, or (autocast) params as they are with only the reduce dtype set."""
    return MixedPrecisionPolicy(param_dtype=None if autocast else torch.bfloat16,
                                reduce_dtype=reduce_dtype)


def _build(layout, z3, policy, **muon):
    R, N = layout
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    model = build_model(get_config("tiny"), seed=0)  # fp32
    dmuon.dedicate_params(model, mesh["shard"], predicate=muon_predicate,
                          replicate_mesh=mesh["replicate"] if R > 1 else None,
                          reshard_after_forward=z3)
    fsdp_mesh = mesh if R > 1 else mesh["shard"]
    for layer in model.model.layers:  # FSDP2's own policy argument reaches DMuon
        dmuon.fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3, mp_policy=policy)
    dmuon.fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3, mp_policy=policy)
    return model, dmuon.Muon(model, **{**MUON, **muon})


def _train(rank, world, layout, z3, reduce_dtype, autocast=False, steps=STEPS):
    model, opt = _build(layout, z3, _policy(reduce_dtype, autocast))
    ledger, out = dmuon.get_ledger(model), {"ledger": [], "calls": []}
    with CollectiveRecorder() as rec:
        for batch in global_batches(steps):
            rows = local_rows(batch, rank, world)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = loss_of(model, rows)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["ledger"].append(ledger.last_step_by_phase())
            out["calls"].append(rec.take())
    out["dtypes"] = {n: p.dtype for n, p in model.named_parameters()}
    out["full"] = dmuon.full_state_dict(model)
    out["memory"] = dmuon.memory_report(model, opt)
    out["owned"] = sorted(dmuon.get_state(model).owned_params)
    return out


def _one_step_changes(rank, world):
    """Fraction of owned master entries a single lr=1e-3 step leaves unchanged."""
    model, opt = _build((1, world), True, _policy(torch.float32), lr=1e-3)
    before = {k: v.detach().clone() for k, v in dmuon.get_state(model).owned_params.items()}
    loss_of(model, local_rows(global_batches(1)[0], rank, world)).backward()
    opt.step()
    after = dmuon.get_state(model).owned_params
    same = sum((after[k] == v).sum().item() for k, v in before.items())
    return same, sum(v.numel() for v in before.values())


@functools.cache
def dist_run(layout, z3, reduce_dtype, autocast=False, steps=STEPS):
    return run(_train, layout, z3, reduce_dtype, autocast, steps, world_size=WORLD)


@functools.cache
def reference(reduce_dtype, autocast=False, steps=STEPS):
    """One process: each rank's micro-batch in bf16 (or fp32 under autocast) on its own,
    gradients averaged over the 4 ranks in ``reduce_dtype`` (rank order), fp32 masters
    stepped by torch.optim.Muon (fp32 standard NS) and AdamW."""
    master = build_model(get_config("tiny"), seed=0)
    names = [n for n, _ in master.named_parameters()]
    opts = reference_optimizers([p for n, p in master.named_parameters() if muon_predicate(n, p)],
                                [p for n, p in master.named_parameters()
                                 if not muon_predicate(n, p)])
    ns = functools.partial(dmuon.newton_schulz, backend="standard", dtype=torch.float32)
    with reference_ns(lambda g, coefficients, steps, eps: ns(g, steps, coefficients=coefficients,
                                                              eps=eps)):
        for batch in global_batches(steps):
            sums = {n: torch.zeros_like(p, dtype=reduce_dtype)
                    for n, p in master.named_parameters()}
            for rank in range(WORLD):
                compute = copy.deepcopy(master)
                if not autocast:
                    compute = compute.to(torch.bfloat16)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss_of(compute, local_rows(batch, rank, WORLD)).backward()
                for n, p in compute.named_parameters():
                    sums[n] += p.grad.to(reduce_dtype)
            for n, p in master.named_parameters():
                p.grad = (sums[n] / WORLD).float()
            for o in opts:
                o.step()
                o.zero_grad()
    return {n: t.detach().clone() for n, t in master.state_dict().items() if n in names}


def _max_rel(results, ref):
    worst = 0.0
    for res in results:
        for key, value in ref.items():
            assert res["full"][key].dtype == torch.float32, key  # masters stay fp32
            worst = max(worst, ((res["full"][key] - value).abs().max()
                                / value.abs().max()).item())
    return worst


def _assert_bitwise(results, ref):
    for res in results:
        assert set(res["full"]) == set(ref)
        for key, value in ref.items():
            assert torch.equal(res["full"][key], value), key


@pytest.mark.parametrize("layout,z3", LAYOUTS, ids=IDS)
def test_bf16_params_fp64_reduce_equal_the_per_microbatch_reference(layout, z3):
    results = dist_run(layout, z3, torch.float64)
    _assert_bitwise(results, reference(torch.float64))
    for res in results:  # dedicated params compute in bf16; FSDP2 shards stay fp32
        for name, dtype in res["dtypes"].items():
            assert dtype == (torch.bfloat16 if name.endswith("proj.weight") else torch.float32)


@pytest.mark.parametrize("layout,z3", LAYOUTS, ids=IDS)
def test_bf16_params_fp32_reduce_within_the_summation_order_spread(layout, z3):
    worst = _max_rel(dist_run(layout, z3, torch.float32), reference(torch.float32))
    print(f"max relative difference after {STEPS} steps: {worst:.2e}")
    assert worst <= FP32_REDUCE_TOL


def test_autocast_keeps_working():
    """fp32 params under torch.autocast(bf16), the reduce in fp64 (exact)."""
    steps = 4
    _assert_bitwise(dist_run((1, 4), True, torch.float64, True, steps),
                    reference(torch.float64, True, steps))


@pytest.mark.parametrize("layout,z3,passes", [((1, 4), False, 2), ((1, 4), True, 3),
                                              ((2, 2), True, 3)], ids=["z2", "z3", "hsdp2x2"])
def test_ledger_counts_param_dtype_gathers_and_reduce_dtype_reduces(layout, z3, passes):
    R, N = layout
    plan = dmuon.partition(build_model(get_config("tiny"), device="meta"),
                           predicate=muon_predicate, shard_size=N, replicate_size=R)
    p_m = plan.total_elements
    gathers = (passes - 1) * p_m * 2 * (N - 1) / N  # bf16
    reduce = p_m * 4 * (N - 1) / N  # fp32
    for rank, res in enumerate(dist_run(layout, z3, torch.float32)):
        row = tuple(range(rank // N * N, rank // N * N + N))  # this rank's shard group
        for ledger, calls in zip(res["ledger"], res["calls"]):
            shard = ledger["shard"]
            assert shard["forward"] + shard.get("backward", 0) == gathers
            assert shard["reduce"] == reduce
            moved = {op: sum(c.wire() for c in calls if c.op == op and c.ranks == row)
                     for op in ("broadcast", "reduce")}
            assert moved == {"broadcast": gathers, "reduce": reduce}


@pytest.mark.parametrize("layout,z3", LAYOUTS, ids=IDS)
def test_cost_model_predicts_the_policys_bytes_and_memory(layout, z3):
    """dmuon.cost (what the planner uses) with bf16 params, fp32 reduce and fp32 masters
    equals the ledger and memory_report of the run, exactly."""
    R, N = layout
    plan = dmuon.partition(build_model(get_config("tiny"), device="meta"),
                           predicate=muon_predicate, shard_size=N, replicate_size=R)
    for rank, res in enumerate(dist_run(layout, z3, torch.float32)):
        assert res["ledger"][-1] == cost.ledger_prediction(plan, rank, z3=z3, param_bytes=2,
                                                           reduce_bytes=4)
        predicted = cost.memory_prediction(plan, rank, z3=z3, param_bytes=2, master_bytes=4)
        assert {k: res["memory"][k] for k in predicted} == predicted


def test_memory_report_uses_real_dtypes():
    for res in dist_run((1, 4), True, torch.float32):
        owned = sum(torch.Size(a).numel() for a in [
            build_model(get_config("tiny"), device="meta").get_parameter(f).shape
            for f in res["owned"]])
        # column values in bf16 and separate fp32 masters; fp32 momentum
        assert res["memory"]["owned_params"] == owned * (2 + 4)
        assert res["memory"]["momentum"] == owned * 4


def test_one_step_at_small_lr_changes_the_fp32_masters():
    same = total = 0
    for s, t in run(_one_step_changes, world_size=WORLD):
        same, total = same + s, total + t
    print(f"unchanged after one lr=1e-3 step: {same} of {total}")
    assert same <= 0.001 * total


# -- fp16 reduces: divided before and after, as FSDP2 does ------------------------------
FP16_GRAD = 2.0e4  # every rank's gradient element: 4 of them sum to 8e4 > fp16's 65504


def _fp16_reduce(rank, world):
    from helpers.model import dedicated_fp16_matrix

    model = dedicated_fp16_matrix(world)
    # d/dW of sum(FP16_GRAD * W x) with x all ones: FP16_GRAD in every element, every rank
    (model(torch.ones(1, 16, dtype=torch.float16)) * FP16_GRAD).sum().backward()
    dmuon.wait_all_reduces(model)
    return {fqn: t.grad for fqn, t in dmuon.get_state(model).owned_params.items()}


def test_fp16_gradients_are_divided_before_the_reduce_so_the_sum_cannot_overflow():
    """Summed first, 4 x 2e4 is inf in fp16; divided by 2 before and 2 after (FSDP2's
    factors for 4 ranks) every sum stays in range and the mean is exact."""
    owned = [g for res in run(_fp16_reduce, world_size=4) for g in res.values()]
    assert len(owned) == 1  # one matrix, one owner
    assert torch.equal(owned[0], torch.full((16, 16), FP16_GRAD))
