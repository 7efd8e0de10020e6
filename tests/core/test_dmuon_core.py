"""DMuon core on a 1-D shard mesh of 4 gloo processes, against independent references."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from helpers.collectives import CollectiveRecorder, DMuonCollectives
from helpers.model import build_model, get_config, muon_predicate
from helpers.train import (
    build_dmuon,
    global_batches,
    gram_ns_flops,
    local_rows,
    lr_lambda,
    reference_run,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.flop_counter import FlopCounterMode

import dmuon
from dmuon.testing import run

STEPS, WORLD, ELT = 10, 4, 8  # float64
MODES = {"z2": False, "z3": True}


def _train(rank, world, z3, adjust_lr_fn, prefetch=1):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model, opt = build_dmuon(mesh, z3, prefetch=prefetch, adjust_lr_fn=adjust_lr_fn)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    state, ledger = dmuon.get_state(model), dmuon.get_ledger(model)
    state.memory_trace = []
    out = {k: [] for k in ("losses", "ledger", "calls", "logical", "flops",
                           "packed_after_forward")}
    with CollectiveRecorder() as rec, DMuonCollectives() as logical:
        for batch in global_batches(STEPS):
            tokens = local_rows(batch, rank, world)
            logits = model(tokens[:, :-1])
            out["packed_after_forward"].append(dmuon.memory_report(model)["packed_buffers"])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            with FlopCounterMode(display=False) as counter, _ns_calls() as chains:
                opt.step()
            out["chains"] = chains
            sched.step()
            opt.zero_grad()
            out["flops"].append(counter.get_total_flops())
            out["calls"].append(rec.take())
            out["logical"].append(logical.take())
            out["ledger"].append({
                p: ledger.last_step("shard", p) for p in ("forward", "backward", "reduce")
            })
            out["losses"].append(loss.item())
    out["trace"] = state.memory_trace
    out["memory"] = dmuon.memory_report(model, opt)
    out["owned"] = sorted(state.owned_params)
    out["full"] = dmuon.full_state_dict(model)
    return out


@contextlib.contextmanager
def _ns_calls():
    """The shape of every NS chain dmuon.Muon runs (its batch, rows, cols)."""
    import dmuon.ns_schedule

    calls, real = [], dmuon.ns_schedule.newton_schulz

    def recording(G, *args, **kwargs):
        calls.append(tuple(G.shape))
        return real(G, *args, **kwargs)

    dmuon.ns_schedule.newton_schulz = recording
    try:
        yield calls
    finally:
        dmuon.ns_schedule.newton_schulz = real


@functools.cache
def dist_run(mode: str, adjust_lr_fn, prefetch=1):
    return run(_train, MODES[mode], adjust_lr_fn, prefetch, world_size=WORLD)


@functools.cache
def reference(adjust_lr_fn):
    return reference_run(STEPS, adjust_lr_fn)


def _muon_shapes():
    model = build_model(get_config("tiny"), device="meta")
    return {n: tuple(p.shape) for n, p in model.named_parameters() if muon_predicate(n, p)}


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_matches_float64_reference(mode, adjust_lr_fn):
    ref_params, ref_losses = reference(adjust_lr_fn)
    results = dist_run(mode, adjust_lr_fn)
    for rank, res in enumerate(results):
        assert set(res["full"]) == set(ref_params), f"rank {rank} keys differ"
        for key, ref in ref_params.items():
            err = _rel_err(res["full"][key], ref)
            assert err <= 1e-9, f"rank {rank} {key}: rel. error {err:.3e}"
    # the local losses average to the reference's global-batch loss
    mean_losses = [sum(r["losses"][i] for r in results) / WORLD for i in range(STEPS)]
    assert mean_losses == pytest.approx(ref_losses, rel=1e-12)


def test_z2_and_z3_are_bit_identical():
    for adjust in (None, "match_rms_adamw"):
        z2, z3 = dist_run("z2", adjust), dist_run("z3", adjust)
        for rank in range(WORLD):
            assert z2[rank]["losses"] == z3[rank]["losses"]
            for key, value in z2[rank]["full"].items():
                assert torch.equal(value, z3[rank]["full"][key]), (rank, key)


@pytest.mark.parametrize("mode,passes", [("z2", 2), ("z3", 3)])
def test_ledger_bytes_per_step(mode, passes):
    shapes = _muon_shapes()
    p_m = sum(torch.Size(s).numel() for s in shapes.values())
    expected = passes * (WORLD - 1) * p_m * ELT / WORLD  # seeds: 2 or 3 (N-1)/N x P_M x elt
    layers = get_config("tiny").n_layers
    fsdp_sizes = _fsdp_all_gather_sizes()
    for rank, res in enumerate(dist_run(mode, None)):
        for step in range(STEPS):
            ledger = res["ledger"][step]
            assert sum(ledger.values()) == expected, (rank, step, ledger)
            assert ledger["backward"] == (0 if mode == "z2" else expected / 3)
            calls = res["calls"][step]
            # independently counted on torch.distributed: DMuon's gathers and reduces
            # (on gloo, point broadcasts and reduces) move exactly the formula's bytes
            gathers = [c for c in calls if c.op == "broadcast"]
            reduces = [c for c in calls if c.op == "reduce"]
            assert sum(c.wire() for c in gathers + reduces) == expected
            # one logical collective per hook boundary and phase
            logical = res["logical"][step]
            assert [x for x in logical if x[0] == "all_gather_v"] == \
                [("all_gather_v", "shard", "forward")] * layers + \
                [("all_gather_v", "shard", "backward")] * (passes - 2) * layers
            assert [x for x in logical if x[0] == "reduce_scatter_v"] == \
                [("reduce_scatter_v", "shard", "reduce")] * layers
            fsdp = {c.numel for c in calls if c.op.startswith("all_gather")}
            assert fsdp <= fsdp_sizes, f"all-gather of non-FSDP2 sizes {fsdp - fsdp_sizes}"
            # two small all-reduces per step: which units got a gradient on any rank and
            # which ranks' gradients were not finite (one flag each, one for FSDP2's);
            # then, after NS, whether any orthogonalised update was not finite
            assert [c.numel for c in calls if c.op == "all_reduce"] == \
                [len(shapes) + WORLD + 1, 1]


def _fsdp_all_gather_sizes():
    """Output sizes of FSDP2's all-gathers: each FSDP2 module's non-Muon params, padded."""
    cfg = get_config("tiny")
    pad = lambda n, rows: -(-rows // WORLD) * WORLD * (n // rows)  # noqa: E731
    layer = 2 * pad(cfg.dim, cfg.dim)  # two RMSNorm weights
    root = 2 * pad(cfg.vocab_size * cfg.dim, cfg.vocab_size) + pad(cfg.dim, cfg.dim)
    return {layer, root}


def test_same_shape_matrices_share_one_batched_chain():
    shapes = _muon_shapes()
    for res in dist_run("z2", None):
        owned = [shapes[f] for f in res["owned"]]
        expected = sorted((owned.count(s), *s) for s in set(owned))
        assert sorted(res["chains"]) == expected  # one chain per shape, batched


def test_newton_schulz_runs_once_per_matrix_per_step():
    per_step = sum(gram_ns_flops(s) for s in _muon_shapes().values())
    results = dist_run("z2", None)
    for step in range(STEPS):
        assert sum(r["flops"][step] for r in results) == per_step
    # and each matrix is owned by exactly one rank
    owned = [fqn for r in results for fqn in r["owned"]]
    assert sorted(owned) == sorted(_muon_shapes())


def test_packed_buffer_memory_z2_and_z3():
    shapes = _muon_shapes()
    p_m_bytes = sum(torch.Size(s).numel() for s in shapes.values()) * ELT
    layer_bytes = {}
    for fqn, s in shapes.items():
        layer = fqn.split(".self_attn")[0].split(".mlp")[0]
        layer_bytes[layer] = layer_bytes.get(layer, 0) + torch.Size(s).numel() * ELT
    layers = list(layer_bytes.values())
    for res in dist_run("z2", None):
        assert res["packed_after_forward"] == [p_m_bytes] * STEPS  # full P_M, not P_M / N
    # Z3 without prefetch: one boundary at a time, none between forward and backward;
    # with the default prefetch of one boundary, the running one and the next, and the
    # last one's re-gather already under way when the forward returns
    for prefetch, peak, after_forward in (
            (0, max(layers), 0),
            (1, max(map(sum, zip(layers, layers[1:]))), layers[-1])):
        for res in dist_run("z3", None, prefetch):
            assert res["packed_after_forward"] == [after_forward] * STEPS
            assert max(b for _, b in res["trace"]) == peak
            assert res["memory"]["packed_buffers"] == 0


def test_prefetch_changes_no_value():
    for a, b in zip(dist_run("z3", None, 0), dist_run("z3", None, 1)):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(v, b["full"][k]) for k, v in a["full"].items())


def test_owner_holds_full_params_and_momentum():
    shapes = _muon_shapes()
    for res in dist_run("z3", None):
        owned_elems = sum(torch.Size(shapes[f]).numel() for f in res["owned"])
        assert res["memory"]["owned_params"] == owned_elems * ELT
        assert res["memory"]["momentum"] == owned_elems * ELT


def _errors(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    out = {}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_model(get_config("tiny"), seed=0)
    fully_shard(model.model.layers[1], mesh=mesh)
    with pytest.raises(RuntimeError) as e:
        dmuon.dedicate_params(model, mesh, predicate=muon_predicate)
    out["fully_shard_first"] = str(e.value)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError) as e:
        dmuon.dedicate_params(build_model(get_config("tiny"), seed=0), hsdp,
                              predicate=muon_predicate)
    out["mesh_2d"] = str(e.value)
    model, opt = build_dmuon(mesh, True)
    out["dtensor"] = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
    out["muon"] = {n: muon_predicate(n, p) for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError) as e:
        model.state_dict()
    out["state_dict"] = str(e.value)
    with pytest.raises(RuntimeError) as e:
        model.model.layers[0].load_state_dict({})
    out["load_state_dict"] = str(e.value)
    return out


def test_errors_name_their_cause():
    for res in run(_errors, world_size=WORLD):
        assert "fully_shard was applied to 'model.layers.1' before" in res["fully_shard_first"]
        assert "2-D mesh" in res["mesh_2d"] and "replicate_mesh" in res["mesh_2d"]
        for key in ("state_dict", "load_state_dict"):
            assert "dmuon.full_state_dict" in res[key] and "placeholder" in res[key]
        # the import-time patch: FSDP2 sharded exactly the params DMuon does not own
        assert res["dtensor"] == {n: not is_muon for n, is_muon in res["muon"].items()}


@pytest.mark.parametrize("kwargs,field", [
    (dict(lr=-1.0), "lr"), (dict(ns_steps=0), "ns_steps"),
    (dict(adjust_lr_fn="bogus"), "adjust_lr_fn"), (dict(ns_backend="svd"), "ns_backend"),
    (dict(ns_coefficients="cubic"), "ns_coefficients"),
])
def test_bad_optimizer_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        dmuon.Muon(torch.nn.Linear(2, 2), **kwargs)
