"""Pure DMuon (``dedicate_params(param_policy=...)``, the reference's
guide "Pure DMuon Routing"): every trainable param enters DMuon; matrices go to
``muon``, norms to ``adamw`` (owner broadcast/reduce, AdamW on the owner), the embedding
and the head to ``sharded_adamw`` (FSDP2's all-gather/reduce-scatter over shards). On 4
gloo ranks, against the float64 single-process reference (torch.optim.Muon + AdamW)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers.collectives import CollectiveRecorder
from helpers.model import build_model, get_config
from helpers.routing import PURE_POLICY, pure_boundaries
from helpers.train import HPARAMS, global_batches, local_rows, loss_of, lr_lambda, reference_run
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

STEPS, WORLD, ELT = 10, 4, 8  # float64

def _pure_train(rank, world, layout, policy_kind="param_policy"):
    R, N = layout
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    policy = {"param_policy": PURE_POLICY,
              "route_hint_fn": lambda n, p: "sharded_adamw" if n.endswith(
                  ("embed_tokens.weight", "lm_head.weight")) else "adamw" if p.ndim == 1
              else "muon"}[policy_kind]
    dmuon.dedicate_params(model, mesh["shard"], predicate=lambda n, p: p.requires_grad,
                          replicate_mesh=mesh["replicate"] if R > 1 else None,
                          hook_boundary_predicate=pure_boundaries(model), **{policy_kind: policy})
    fsdp_mesh = mesh if R > 1 else mesh["shard"]
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=fsdp_mesh)
    dmuon.fully_shard(model, mesh=fsdp_mesh)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    out = {"ledger": [], "calls": [], "losses": [],
           "groups": [(g["dmuon_route"], g["kind"], len(g["params"])) for g in opt.param_groups]}
    with CollectiveRecorder() as rec:
        for batch in global_batches(STEPS):
            loss = loss_of(model, local_rows(batch, rank, world))
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
            out["calls"].append(rec.take())
            out["ledger"].append(dmuon.get_ledger(model).last_step_by_phase())
    out["summary"] = json.loads(json.dumps(dmuon.summarize_param_groups(model, opt)))
    out["comm_plan"] = json.loads(json.dumps(dmuon.summarize_comm_plan(model)))
    out["profile"] = dmuon.collect_forward_unshard_profile(model)
    ctx = dmuon.get_comm_ctx(model)
    out["ctx"] = (type(ctx).__name__, [name for name, _ in ctx.communicators],
                  dmuon.get_comm_ctx(torch.nn.Linear(2, 2)))
    out["full"] = dmuon.full_state_dict(model)
    out["plan"] = dmuon.get_plan(model).to_dict()
    out["routes"] = {n: p.route for n, p in dmuon.get_state(model).policies.items()}
    return out


@functools.cache
def pure(layout=(1, WORLD), policy_kind="param_policy"):
    return run(_pure_train, layout, policy_kind, world_size=WORLD)


@functools.cache
def reference():
    """torch.optim.Muon on the layers' matrices, AdamW on everything else: the same
    split as the policy's (norms' AdamW on an owner is AdamW)."""
    return reference_run(STEPS)


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _sizes():
    """(matrix elements, norm elements, embedding + head elements) of the tiny model."""
    c = get_config("tiny")
    matrices = c.n_layers * (c.dim * c.dim * 2 + 2 * c.dim * c.n_kv_heads * c.head_dim
                             + 3 * c.dim * c.ffn_dim)
    return matrices, (2 * c.n_layers + 1) * c.dim, 2 * c.vocab_size * c.dim


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["z3-1x4", "hsdp-2x2"])
def test_pure_dmuon_matches_float64_reference(layout):
    ref, ref_losses = reference()
    results = pure(layout)
    for rank, res in enumerate(results):
        assert set(res["full"]) == set(ref)
        for key, value in ref.items():
            err = _rel_err(res["full"][key], value)
            assert err <= 1e-9, f"rank {rank} {key}: rel. error {err:.3e}"
        assert res["routes"]["model.embed_tokens.weight"] == "sharded_adamw"
        assert res["routes"]["model.norm.weight"] == "adamw"
        assert res["routes"]["model.layers.0.mlp.up_proj.weight"] == "muon"
    per_step = [sum(r["losses"][i] for r in results) / WORLD for i in range(STEPS)]
    assert per_step == pytest.approx(ref_losses, rel=1e-12)


def test_route_hint_fn_is_the_same_routing():
    a, b = pure((1, 4)), pure((1, 4), "route_hint_fn")
    for ra, rb in zip(a, b):
        assert ra["plan"] == rb["plan"]
        for key, value in ra["full"].items():
            assert torch.equal(value, rb["full"][key]), key


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["z3-1x4", "hsdp-2x2"])
def test_bytes_per_route(layout):
    """Owner routes: DMuon's all-gathers from the owners and reduces to them, 3 (N-1)/N
    of their elements per step in Z3 on the shard dim, and 2 (R-1)/R of the column's on
    the replicate dim; sharded routes: FSDP2's one all-gather and one reduce-scatter of
    the embedding and head, and nothing else of FSDP2 (the layers hold no FSDP2 param)."""
    R, N = layout
    p_m, p_a, p_s = _sizes()
    for rank, res in enumerate(pure(layout)):
        column = [0] * N
        for a in res["plan"]["params"].values():
            column[a["owner_coord"][1]] += a["numel"]
        routes = {a["param"]: a["route"] for a in res["plan"]["params"].values()}
        assert sum(1 for r in routes.values() if r == "adamw") == 2 * 2 + 1
        for step in range(STEPS):
            ledger = res["ledger"][step]
            shard = sum(ledger["shard"][p] for p in ("forward", "backward", "reduce"))
            assert shard == 3 * (N - 1) * (p_m + p_a) * ELT / N, (rank, step)
            if R > 1:
                replicate = ledger["replicate"]["reduce"] + ledger["replicate"]["replicate"]
                assert replicate == 2 * (R - 1) * column[rank % N] * ELT / R
            calls = res["calls"][step]
            owner = [c for c in calls if c.op in ("broadcast", "reduce")]
            row = tuple(range(rank // N * N, rank // N * N + N))  # this rank's shard group
            assert sum(c.wire() for c in owner if c.ranks == row) == 3 * (N - 1) \
                * (p_m + p_a) * ELT / N
            # FSDP2 on gloo: the recorder sees the gather's whole output, and the
            # reduce-scatter's output (one shard: its first argument)
            sharded = sorted((c.op, c.numel, c.n) for c in calls
                             if c.op.startswith(("all_gather", "reduce_scatter")))
            assert sharded == [("all_gather_single", p_s, N),
                               ("reduce_scatter_single", p_s // N, N)], (rank, step, sharded)
            if R > 1:  # FSDP2's HSDP all-reduce of its shard over the replicate dim
                assert [c.numel for c in calls if c.op == "all_reduce" and c.numel > 100] \
                    == [p_s // N]


def test_param_groups_split_by_route():
    res = pure((1, 4))
    for r in res:
        routes = [g[:2] for g in r["groups"]]
        assert routes == [("muon", "muon"), ("adamw", "adamw")]
    # every owned master is in exactly one group, over all ranks
    owned = sum(g[2] for r in res for g in r["groups"][:1])
    assert owned == 2 * 7
    adamw_masters = sum(r["groups"][1][2] for r in res) - WORLD * 2  # 2 FSDP2 shards each
    assert adamw_masters == 2 * 2 + 1


def _matrices_and_norms(n, p):
    return "adamw" if p.ndim == 1 else "muon"


@pytest.mark.parametrize("kwargs,match", [
    ({"param_policy": {"defaults": {"route": "adam"}}}, r"defaults.route='adam'"),
    ({"param_policy": {"defaults": {"rout": "muon"}}}, r"unknown fields \['rout'\]"),
    ({"param_policy": {"overrides": [{"set": {"route": "adamw"}}]}},
     r"overrides\[0\] needs exactly one of 'name' or 'contains'"),
    ({"param_policy": {"overrides": [{"name": "norm"}]}}, r"overrides\[0\] has no 'set'"),
    ({"param_policy": {"overrides": [{"name": "norm", "set": {"param_dtype": "bf16"}}]}},
     r"overrides\[0\].set.param_dtype must be a torch.dtype"),
    ({"param_policy": {"default": {}}}, r"unknown keys \['default'\]"),
    ({"param_policy": {}, "route_hint_fn": _matrices_and_norms}, r"takes one of"),
    ({"param_policy_fn": lambda n, p: {"route": "sharded"}}, r"param_policy_fn\('"),
    # a norm left on the default route: Muon cannot orthogonalise it
    ({"param_policy": {"overrides": [{"name": "embed", "set": {"route": "adamw"}}]}},
     r"'model.layers.0.input_layernorm.weight' \(64,\) is routed to 'muon'"),
])
def test_malformed_policies_are_refused_by_name(kwargs, match):
    model = build_model(get_config("tiny"), device="meta")
    with pytest.raises((ValueError, TypeError), match=match):
        dmuon.dedicate_params(model, None, predicate=lambda n, p: True, **kwargs)


def test_override_rules():
    """Ordered overrides, each setting only its fields; ``contains`` is ``name``; a
    missing route is ``muon``."""
    from dmuon.routing import structured_policy

    resolve = structured_policy({
        "defaults": {"route": "adamw", "param_dtype": torch.bfloat16},
        "overrides": [{"name": ["proj"], "set": {"route": None}},
                      {"contains": "q_proj", "set": {"grad_dtype": torch.float32}},
                      {"name": "q_proj", "set": {"route": "sharded_adamw"}}]})
    q = resolve("layers.0.self_attn.q_proj.weight", None)
    assert (q.route, q.param_dtype, q.grad_dtype, q.matched) == \
        ("sharded_adamw", torch.bfloat16, torch.float32, (0, 1, 2))
    k = resolve("layers.0.self_attn.k_proj.weight", None)
    assert (k.route, k.grad_dtype, k.matched) == ("muon", None, (0,))
    assert resolve("norm.weight", None).route == "adamw"


def _pure_ddp(rank, world):
    """The DDP composition (R x 1: every rank keeps every param) with the pure policy:
    owners step matrices (Muon) and norms (AdamW), ``replicate`` all-reduces the
    embedding and head."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    dmuon.dedicate_params_ddp(model, mesh, predicate=lambda n, p: p.requires_grad,
                              hook_boundary_predicate=pure_boundaries(model),
                              param_policy=PURE_POLICY, process_group_policy="isolated")
    dmuon.replicate(model, mesh)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    for batch in global_batches(STEPS):
        loss_of(model, local_rows(batch, rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"full": dmuon.full_state_dict(model),
            "ledger": dmuon.get_ledger(model).last_step_by_phase()}


def test_pure_dmuon_on_the_ddp_composition():
    ref, _ = reference()
    p_m, p_a, _ = _sizes()
    for rank, res in enumerate(run(_pure_ddp, world_size=WORLD)):
        for key, value in ref.items():
            assert _rel_err(res["full"][key], value) <= 1e-9, (rank, key)
        # owner routes only: each matrix and norm reduced to its owner and published
        # back, 2 (R-1)/R of their elements over the replicate dim, nothing on the shard dim
        ledger = res["ledger"]
        assert ledger["replicate"]["reduce"] + ledger["replicate"]["replicate"] == \
            2 * (WORLD - 1) * (p_m + p_a) * ELT / WORLD


def _pure_ddp_tp(rank, world):
    """DDP x TP 2 x 2: TP on the layers' matrices first, then the reference's
    ``dedicate_params_ddp_tp`` + ``replicate_tp`` with the pure policy."""
    from test_tp import _tp_plan
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], _tp_plan())
    dmuon.dedicate_params_ddp_tp(model, mesh["dp"], predicate=lambda n, p: p.requires_grad,
                                 hook_boundary_predicate=pure_boundaries(model),
                                 param_policy=PURE_POLICY)
    dmuon.replicate_tp(model, mesh["dp"])
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    dp = mesh["dp"].get_local_rank()
    for batch in global_batches(STEPS):
        loss_of(model, local_rows(batch, dp, 2)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"full": dmuon.full_state_dict(model),
            "ledger": dmuon.get_ledger(model).last_step_by_phase()}


def test_pure_dmuon_on_ddp_x_tp():
    ref, _ = reference()
    p_m, p_a, _ = _sizes()
    DP, TP = 2, 2
    for rank, res in enumerate(run(_pure_ddp_tp, world_size=WORLD)):
        for key, value in ref.items():
            assert _rel_err(res["full"][key], value) <= 1e-9, (rank, key)
        # each TP rank moves its half of every matrix and the whole norms: reduced to
        # the owner and published back over the data-parallel row
        ledger = res["ledger"]
        assert ledger["replicate"]["reduce"] + ledger["replicate"]["replicate"] == \
            2 * (DP - 1) * (p_m // TP + p_a) * ELT / DP
        assert ledger["tp"]["step"] > 0  # NS of the TP shards talks over the TP group


def _pure_resume(rank, world, path, layout):
    """5 steps, a sharded checkpoint, a fresh model resumed from it for 5 more: the
    ``adamw`` route's AdamW state lives on the owners and travels with the masters."""
    R, N = layout
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    out = {}
    for phase in ("first", "resumed"):
        model = build_model(get_config("tiny"), dtype=torch.float64, seed=1 if phase ==
                            "resumed" else 0)
        dmuon.dedicate_params(model, mesh["shard"], predicate=lambda n, p: p.requires_grad,
                              replicate_mesh=mesh["replicate"] if R > 1 else None,
                              hook_boundary_predicate=pure_boundaries(model),
                              param_policy=PURE_POLICY)
        fsdp_mesh = mesh if R > 1 else mesh["shard"]
        for layer in model.model.layers:
            dmuon.fully_shard(layer, mesh=fsdp_mesh)
        dmuon.fully_shard(model, mesh=fsdp_mesh)
        opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        start = 0
        if phase == "resumed":
            start = dmuon.checkpoint.load(path, model, opt)["step"]
            for _ in range(start):
                sched.step()
        for step, batch in enumerate(global_batches(STEPS)):
            if step < start or (phase == "first" and step >= STEPS // 2):
                continue
            loss_of(model, local_rows(batch, rank, world)).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        if phase == "first":
            dmuon.checkpoint.save(path, model, opt, extra={"step": STEPS // 2})
    out["full"] = dmuon.full_state_dict(model)
    return out


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["z3-1x4", "hsdp-2x2"])
def test_pure_dmuon_resumes_from_a_checkpoint(layout, tmp_path):
    straight = pure(layout)
    resumed = run(_pure_resume, str(tmp_path / "ckpt"), layout, world_size=WORLD)
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        for key, value in a["full"].items():
            assert torch.equal(b["full"][key], value), (rank, key)
