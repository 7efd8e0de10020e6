"""The reference implementation's own set-ups, as its test suite writes them, on 4 gloo
ranks in float64, each against an independent single-process reference:

- its mixed precision: ``dedicate_params(..., compute_dtype=bf16)`` beside
  ``fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=bf16))``: two policies, DMuon's for the dedicated params (compute and
  gather in bf16, reduce in the masters' float64) and FSDP2's for the rest (bf16 reduce);
- its predicate ``"proj" in n`` on a Hugging Face Qwen2 model, which also catches the 1-D
  ``q_proj``/``k_proj``/``v_proj`` biases: they go to AdamW, with one warning naming them;
- ``use_muon`` in every param group, and ``wait_all_replicate_broadcasts`` /
  ``wait_all_post_step_broadcasts`` (also from ``dmuon.utils``) on HSDP 2x2.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
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
import dmuon.utils
from dmuon.model_state import is_dedicated
from dmuon.testing import run

WORLD, BF16 = 4, torch.bfloat16
FSDP2_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)  # the reference's
MP_STEPS = 3
# Bound on FSDP2's bf16 average of the 4 ranks' bf16 gradients, per element: 3 additions,
# each rounded to bf16 (unit roundoff u = 2^-8), in whatever order gloo chooses, are off
# the exact sum by at most gamma_3 = 3u / (1 - 3u) < 3.1u times the sum of the magnitudes
# (Higham, Accuracy and Stability of Numerical Algorithms, 4.2); dividing by 4 is exact.
BF16_AVERAGE_BOUND = 3.1 * 2.0**-8


# -- the reference's mixed precision ---------------------------------------------------------

def _gradients(model, state) -> dict:
    """The owners' averaged dedicated gradients and FSDP2's averaged ones, in full."""
    dmuon.wait_all_reduces(model)
    owned = {state.plan.params[u].param: t.grad.clone() for u, t in state.owned_params.items()}
    fsdp2 = {n: p.grad.full_tensor() for n, p in model.named_parameters() if not is_dedicated(p)}
    return {"dedicated": owned, "fsdp2": fsdp2}


def _one_policy_when_fully_shard_sets_it(mesh) -> str:
    """Without a policy of DMuon's own, the first ``fully_shard`` policy over a hook
    boundary is both kinds' and a different one later is refused."""
    model = build_model(get_config("tiny"), dtype=torch.float32, seed=0)
    dmuon.dedicate_params(model, mesh, muon_predicate)
    dmuon.fully_shard(model.model.layers[0], mesh=mesh, mp_policy=FSDP2_POLICY)
    with pytest.raises(ValueError) as refused:
        dmuon.fully_shard(model.model.layers[1], mesh=mesh, mp_policy=MixedPrecisionPolicy(
            param_dtype=BF16, reduce_dtype=torch.float32))
    return str(refused.value)


def _mixed_precision(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    dmuon.dedicate_params(model, mesh, muon_predicate, compute_dtype=BF16)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh, mp_policy=FSDP2_POLICY)
    dmuon.fully_shard(model, mesh=mesh, mp_policy=FSDP2_POLICY)
    opt = dmuon.Muon(model, **HPARAMS, ns_backend="standard", ns_dtype=torch.float64)
    state = dmuon.get_state(model)
    out = {"policy": state.mp_policy, "steps": [], "ledger": []}
    for batch in global_batches(MP_STEPS):
        loss_of(model, local_rows(batch, rank, world)).backward()
        out["steps"].append(_gradients(model, state))
        opt.step()
        opt.zero_grad()
        out["ledger"].append(dmuon.get_ledger(model).last_step_by_phase())
    out["full"] = dmuon.full_state_dict(model)
    out["refused"] = _one_policy_when_fully_shard_sets_it(mesh)
    return out


@functools.cache
def _mp_runs():
    return run(_mixed_precision, world_size=WORLD)


def _micro_batch_gradients(master, batch) -> list[dict]:
    """Each rank's micro-batch on its own copy of the masters cast to bf16."""
    import copy

    grads = []
    for rank in range(WORLD):
        compute = copy.deepcopy(master).to(BF16)
        loss_of(compute, local_rows(batch, rank, WORLD)).backward()
        grads.append({n: p.grad for n, p in compute.named_parameters()})
    return grads


def _check_fsdp2_average(name, runs, step, grads, exact) -> torch.Tensor:
    """FSDP2's bf16 average: the same on every rank, bf16 values, within the bound."""
    got = runs[0]["steps"][step]["fsdp2"][name]
    magnitude = sum(g[name].double().abs() for g in grads) / WORLD
    for res in runs:
        assert torch.equal(res["steps"][step]["fsdp2"][name], got), name
    assert torch.equal(got.to(BF16).double(), got), name  # reduced in bf16, its policy
    excess = (got - exact).abs() - BF16_AVERAGE_BOUND * magnitude
    assert excess.max().item() <= 0.0, (step, name)
    return got


def _owner_gradient(runs, step, name) -> torch.Tensor:
    held = [res["steps"][step]["dedicated"][name] for res in runs
            if name in res["steps"][step]["dedicated"]]
    assert len(held) == 1, name
    return held[0]


def _mp_reference_checked(runs) -> dict:
    """One process: each rank's micro-batch in bf16, the dedicated gradients averaged in
    float64 (exact for bf16 values), torch.optim.Muon + AdamW on float64 masters. Each
    step checks the run's gradients first: the owners' equal the exact average bit for
    bit; FSDP2's bf16 average lies within ``BF16_AVERAGE_BOUND`` of it and is what the
    reference's AdamW then steps with (FSDP2's reduce order is gloo's; everything else
    must stay bit-identical)."""
    master = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    named = dict(master.named_parameters())
    opts = reference_optimizers([p for n, p in named.items() if muon_predicate(n, p)],
                                [p for n, p in named.items() if not muon_predicate(n, p)])
    # the same NS arithmetic as the run (dmuon's standard NS is checked against
    # torch.optim.Muon's in test_newton_schulz), so that the comparison can be exact
    ns = functools.partial(dmuon.newton_schulz, backend="standard", dtype=torch.float64)
    with reference_ns(lambda g, coefficients, steps, eps: ns(g, steps, coefficients=coefficients,
                                                              eps=eps)):
        for step, batch in enumerate(global_batches(MP_STEPS)):
            grads = _micro_batch_gradients(master, batch)
            for name, p in named.items():
                exact = sum(g[name].double() for g in grads) / WORLD
                if muon_predicate(name, p):
                    assert torch.equal(_owner_gradient(runs, step, name), exact), (step, name)
                    p.grad = exact
                else:
                    p.grad = _check_fsdp2_average(name, runs, step, grads, exact)
            for o in opts:
                o.step()
                o.zero_grad()
    return {n: t.detach().clone() for n, t in master.state_dict().items()}


def test_reference_mixed_precision_pairing_matches_the_per_microbatch_reference():
    runs = _mp_runs()
    ref = _mp_reference_checked(runs)
    for res in runs:
        assert set(res["full"]) == set(ref)
        for key, value in ref.items():
            assert torch.equal(res["full"][key], value), key


def test_the_pairing_is_two_policies():
    plan = dmuon.partition(build_model(get_config("tiny"), device="meta"),
                           predicate=muon_predicate, shard_size=WORLD)
    p_m, share = plan.total_elements, (WORLD - 1) / WORLD
    for res in _mp_runs():
        # DMuon's: compute_dtype gathers in bf16 (Z3: forward and backward), reduces in
        # the masters' float64
        assert res["policy"] == MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float64)
        for ledger in res["ledger"]:
            assert ledger["shard"]["forward"] + ledger["shard"]["backward"] == 2 * p_m * 2 * share
            assert ledger["shard"]["reduce"] == p_m * 8 * share
        for step in res["steps"]:  # float64 averages of bf16 values: not all bf16 values
            assert any(not torch.equal(g.to(BF16).double(), g) for g in step["dedicated"].values())


def test_a_second_fully_shard_policy_is_refused_when_fully_shard_set_dmuons():
    assert "one policy per dedicated model" in _mp_runs()[0]["refused"]


# -- the reference's predicate on a Qwen2-style model, use_muon, the waits -------------------

QWEN2 = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             tie_word_embeddings=False, use_cache=False)
QWEN2_STEPS, LAYOUT = 5, (2, 2)
BIASES = [f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv"]


def proj(name, param) -> bool:
    """The reference's tests' predicate."""
    return "proj" in name


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**QWEN2)).to(torch.float64)


def lm_loss(model, tokens):
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _group_claims(model, opt, state) -> list[tuple]:
    """(use_muon, kind, params are this rank's Muon masters, params are FSDP2's) per group."""
    masters = {id(t) for t in state.owned_params.values()}
    fsdp2 = {id(p) for p in model.parameters() if not is_dedicated(p)}
    return [(g["use_muon"], g["kind"], all(id(p) in masters for p in g["params"]),
             all(id(p) in fsdp2 for p in g["params"])) for g in opt.param_groups]


def _user_groups(model) -> dict:
    dedicated = [p for p in model.parameters() if is_dedicated(p)]
    rest = [p for p in model.parameters() if not is_dedicated(p)]
    return {"torch_style": dmuon.Muon([{"params": dedicated, "lr": 0.01}, {"params": rest}]),
            "named": dmuon.Muon(model, param_groups=[
                {"params": list(model.model.layers.parameters()), "group_name": "layers"},
                {"params": [p for n, p in model.named_parameters() if ".layers." not in n],
                 "group_name": "rest", "adamw_lr": 1e-3}])}


def _replicas(state) -> dict:
    """What the replicate waits claim: none pending, and this rank's column values."""
    return {"pending": [b.transfer.replicate is not None for b in state.boundaries],
            "column": {m.fqn: b.column_view(m).clone() for b in state.boundaries
                       for m in b.column},
            "masters": {fqn: t.detach().clone() for fqn, t in state.owned_params.items()}}


def _qwen2_train(rank, world):
    R, N = LAYOUT
    mesh = init_device_mesh("cpu", LAYOUT, mesh_dim_names=("replicate", "shard"))
    model = qwen2()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dmuon.dedicate_params(model, mesh["shard"], proj, replicate_mesh=mesh["replicate"])
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    state = dmuon.get_state(model)
    out = {"warnings": [str(w.message) for w in caught], "dedicated": sorted(plan.param_fqns),
           "claims": {k: _group_claims(model, o, state) for k, o in _user_groups(model).items()}}
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    out["claims"]["model"] = _group_claims(model, opt, state)
    waits = {1: dmuon.wait_all_replicate_broadcasts, 3: dmuon.utils.wait_all_post_step_broadcasts}
    out["waits"] = {}
    for step, batch in enumerate(global_batches(QWEN2_STEPS)):
        lm_loss(model, local_rows(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if step in waits:
            before = [b.transfer.replicate is not None for b in state.boundaries]
            waits[step](model)
            out["waits"][step] = {"before": before, **_replicas(state)}
    out["full"] = dmuon.full_state_dict(model)
    return out


@functools.cache
def _qwen2_runs():
    return run(_qwen2_train, world_size=WORLD)


def _qwen2_reference() -> dict:
    """One float64 process on the global batch: torch.optim.Muon (float64 NS) on the 2-D
    ``proj`` matrices, AdamW on the rest, the biases among them."""
    model = qwen2()
    named = dict(model.named_parameters())
    muon = [p for n, p in named.items() if proj(n, p) and p.ndim == 2]
    opts = reference_optimizers(muon, [p for n, p in named.items()
                                       if not (proj(n, p) and p.ndim == 2)])
    with reference_ns():
        for batch in global_batches(QWEN2_STEPS):
            lm_loss(model, batch).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_proj_predicate_sends_qwen2_biases_to_adamw_and_matches_the_reference():
    ref = _qwen2_reference()
    for rank, res in enumerate(_qwen2_runs()):
        assert not set(BIASES) & set(res["dedicated"])
        assert {n for n in ref if proj(n, ref[n]) and ref[n].ndim == 2} == set(res["dedicated"])
        for key, value in ref.items():
            err = ((res["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (rank, key, err)


def test_one_warning_names_every_param_routed_to_adamw():
    for res in _qwen2_runs():
        routed = [w for w in res["warnings"] if "AdamW" in w]
        assert len(routed) == 1, res["warnings"]
        for name in BIASES:
            assert f"'{name}' " in routed[0]
        assert routed[0].count("'") == 2 * len(BIASES)  # and nothing else


def test_use_muon_says_which_optimizer_steps_the_group():
    for res in _qwen2_runs():
        for key, claims in res["claims"].items():
            kinds = [kind for _, kind, _, _ in claims]
            assert "muon" in kinds and "adamw" in kinds, key
            for use_muon, kind, muon_masters, fsdp2 in claims:
                assert use_muon is (kind == "muon"), key
                assert (muon_masters, fsdp2) == ((True, False) if use_muon else (False, True)), \
                    (key, claims)


def test_replicate_waits_leave_nothing_pending_and_replicas_hold_the_owners_values():
    runs = _qwen2_runs()
    plan = dmuon.partition(qwen2(), predicate=lambda n, p: proj(n, p) and p.ndim == 2,
                           shard_size=LAYOUT[1],
                           replicate_size=LAYOUT[0])
    for step in (1, 3):
        for rank, res in enumerate(runs):
            seen = res["waits"][step]
            assert any(seen["before"]) and not any(seen["pending"]), (step, rank)
            for unit, value in seen["column"].items():
                owner = runs[plan.params[unit].owner]["waits"][step]["masters"][unit]
                assert torch.equal(value, owner), (step, rank, unit)
        # each unit sits in its column on all R ranks of it, the owner and its replicas
        holders = [sum(unit in res["waits"][step]["column"] for res in runs)
                   for unit in plan.params]
        assert holders == [LAYOUT[0]] * len(plan.params)
