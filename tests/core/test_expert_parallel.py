"""Expert parallelism in the core (``dmuon.shard_experts``): an MoE of 2 layers, 8 experts
each (3-D weights, top 2 of a softmax router), on 4 gloo ranks in float64, its tokens
dispatched over the EP group (``dmuon.dispatch_combine``) and each EP coordinate's
experts owned inside its expert shard group. Against a single-process reference written
here (one 2-D parameter per expert, torch.optim.Muon + AdamW, every token through its
experts in a loop), 10 steps, every param on every rank within 1e-9, as EP 2 x expert
shard 2, EP 4, HSDP 2 x 2 with EP 2, and 1 x 2 x 2 with TP (the dense projection split,
the experts EP 2 over the shard group and whole on each TP rank); Z2 bitwise equal to
Z3, a synchronous replicate all-gather to the asynchronous one. At step 4 the router
sends no token to expert 5 on any rank: it gets no gradient anywhere and is left alone,
as torch.optim leaves a param without one. Then the ledger, the expert storage peak,
the planner's predictions, and an EP 2 checkpoint loaded on EP 1 and EP 4."""

from __future__ import annotations

import functools
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from helpers.layer_stack import LayerStack
from helpers.train import HPARAMS, lr_lambda, reference_ns, reference_optimizers
from torch import nn

import dmuon
from dmuon.buffers import resident_bytes
from dmuon.expert_dispatch import grouped_linear
from dmuon.testing import run

D, H, E, K, VOCAB, LAYERS, STEPS, ROWS, SEED = 16, 24, 8, 2, 64, 2, 10, 16, 3
BANNED, BANNED_STEP = 5, 3  # expert 5 gets no token at the 4th step
NO_CLIP = 1e9  # clip_grad_norm_ for the norm alone
# (replicate, shard, ep, z3)
LAYOUTS = {"ep2x2": (1, 4, 2, True), "ep4": (1, 4, 4, True), "hsdp2x2_ep2": (2, 2, 2, True),
           "ep2x2_z2": (1, 4, 2, False), "ep1": (1, 4, 1, True),
           "hsdp2x2_ep2_sync": (2, 2, 2, True),  # the replicate all-gather waited for
           "tp1x2x2_ep2": (1, 2, 2, True)}  # 2 TP ranks each: the 4 ranks' rest
SAVE_AT = 5


class Experts(nn.Module):
    """This rank's experts as 3-D weights, called once with every local row, grouped by
    expert (``dmuon.expert_dispatch.RowGroups``)."""

    def __init__(self, count: int = E):
        super().__init__()
        self.up = nn.Parameter(torch.empty(count, H, D))
        self.down = nn.Parameter(torch.empty(count, D, H))

    def reset_parameters(self):
        nn.init.normal_(self.up, std=0.2)
        nn.init.normal_(self.down, std=0.2)

    def forward(self, rows: torch.Tensor, groups) -> torch.Tensor:
        return grouped_linear(F.silu(grouped_linear(rows, self.up, groups)), self.down, groups)


def route(logits: torch.Tensor, banned: bool):
    if banned:
        logits = logits.masked_fill(torch.arange(E) == BANNED, float("-inf"))
    weights, choices = logits.softmax(-1).topk(K, dim=-1)
    return weights / weights.sum(-1, keepdim=True), choices


class MoELayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()
        self.proj = nn.Linear(D, D, bias=False)
        self.ep_group, self.ledger, self.banned = None, None, False

    def forward(self, x):
        h = self.norm(x).reshape(-1, D)
        weights, choices = route(self.router(h), self.banned)
        out = dmuon.dispatch_combine(h, choices, weights, self.experts, E, self.ep_group,
                                     self.ledger)
        return x + self.proj(out.view_as(x))


class LoopLayer(nn.Module):
    """The reference: the same layer with one 2-D parameter per expert."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.norm, self.router, self.proj = layer.norm, layer.router, layer.proj
        self.up = nn.ParameterList([nn.Parameter(w.clone()) for w in layer.experts.up.detach()])
        self.down = nn.ParameterList([nn.Parameter(w.clone())
                                      for w in layer.experts.down.detach()])
        self.banned = False

    def forward(self, x):
        h = self.norm(x).reshape(-1, D)
        weights, choices = route(self.router(h), self.banned)
        out = torch.zeros_like(h)
        for e in range(E):
            rows, slot = (choices == e).nonzero(as_tuple=True)
            expert = F.silu(h[rows] @ self.up[e].T) @ self.down[e].T
            out = out.index_add(0, rows, expert * weights[rows, slot, None])
        return x + self.proj(out.view_as(x))


def net() -> LayerStack:
    return LayerStack(MoELayer, LAYERS, VOCAB, D)


def is_muon(name, p):
    return name.startswith("layers.") and p.ndim >= 2 and ".router." not in name


def is_boundary(module) -> bool:
    return isinstance(module, (MoELayer, Experts))


def batches(banned: bool = True):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (ROWS, 9), generator=g), banned and step == BANNED_STEP)
            for step in range(STEPS)]


def loss_of(model, tokens, banned: bool):
    for layer in model.layers:
        layer.banned = banned
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


@functools.cache
def reference(banned: bool = True) -> tuple[dict, list[float]]:
    torch.manual_seed(0)
    model = net().double()
    dmuon.init_weights(model, seed=SEED)
    model.layers = nn.ModuleList(LoopLayer(layer) for layer in model.layers)
    named = list(model.named_parameters())
    opts = reference_optimizers([p for n, p in named if is_muon(n, p)],
                                [p for n, p in named if not is_muon(n, p)])
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in opts]
    norms = []  # Muon's update does not see a gradient's scale: the norms do
    with reference_ns():
        for batch, ban in batches(banned):
            loss_of(model, batch, ban).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), NO_CLIP).item())
            for o, s in zip(opts, scheds):
                o.step()
                s.step()
                o.zero_grad()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i in range(LAYERS):
        for name in ("up", "down"):
            sd[f"layers.{i}.experts.{name}"] = torch.stack(
                [sd.pop(f"layers.{i}.{name}.{e}") for e in range(E)])
    return sd, norms


def _tensor_parallel(model, mesh) -> None:
    """Under TP the dense projection is split (colwise, its output gathered) and the
    experts stay whole on every TP rank, expert-parallel over the shard group."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    for layer in model.layers:
        parallelize_module(layer, mesh["tp"],
                           {"proj": ColwiseParallel(output_layouts=Replicate())})


def _setup(layout):
    from torch.distributed.device_mesh import init_device_mesh

    R, N, P, z3 = layout
    T = 4 // (R * N)
    mesh = init_device_mesh("cpu", (R, N, T), mesh_dim_names=("replicate", "shard", "tp"))
    with torch.device("meta"):
        model = net().double()
    if T > 1:
        _tensor_parallel(model, mesh)
    ep_group = dmuon.shard_experts(model, is_muon, mesh["shard"], ep_size=P)
    for layer in model.layers:
        layer.ep_group = ep_group
    dmuon.dedicate_params(model, mesh["shard"], is_muon, hook_boundary_predicate=is_boundary,
                          replicate_mesh=mesh["replicate"] if R > 1 else None,
                          reshard_after_forward=z3)
    dp = mesh["replicate", "shard"] if R > 1 or T > 1 else mesh["shard"]
    for layer in model.layers:
        dmuon.fully_shard(layer, mesh=dp, reshard_after_forward=z3)
    dmuon.fully_shard(model, mesh=dp, reshard_after_forward=z3)
    dmuon.materialize(model, seed=SEED)
    for layer in model.layers:
        layer.ledger = dmuon.get_ledger(model)
    return mesh, model


def _expert_storage_peak(model) -> list[int]:
    """The most bytes the expert boundaries' buffers held at once, kept up to date at
    every gather and free the hooks trace."""
    state, peak = dmuon.get_state(model), [0]
    experts = [b for b in state.boundaries if b.ctx is state.expert_ctx]
    state.memory_trace, traced = [], state.trace

    def trace(event: str) -> None:
        peak[0] = max(peak[0], sum(b.live_bytes() for b in experts))
        traced(event)

    state.trace = trace
    return peak


def _train(rank, world, layout_id, path=None, save_at=None, load=False):
    mesh, model = _setup(LAYOUTS[layout_id])
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64,
                     replicate_async=not layout_id.endswith("_sync"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    (R, N, *_), dp = LAYOUTS[layout_id], mesh["shard"].get_local_rank()
    dp += mesh["replicate"].get_local_rank() * N  # a TP group's ranks share their rows
    out, start, per, norms = {}, 0, ROWS // (R * N), []
    peak = _expert_storage_peak(model)
    if load:
        start = dmuon.checkpoint.load(path, model, opt)["step"]
        sched.last_epoch = start
        out["loaded"] = dmuon.full_state_dict(model)
    for step, (batch, ban) in enumerate(batches()):
        if step < start:
            continue
        loss_of(model, batch[dp * per:(dp + 1) * per], ban).backward()
        norms.append(dmuon.clip_grad_norm_(model, NO_CLIP).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        if save_at == step + 1:
            dmuon.checkpoint.save(path, model, opt, extra={"step": step + 1})
            out["saved"] = dmuon.full_state_dict(model)
    plan, ledger = dmuon.get_plan(model), dmuon.get_ledger(model)
    out["ledger"] = {(d, p): ledger.last_step(d, p) for d in ("shard", "ep")
                     for p in ("forward", "backward", "reduce")}
    out["expert_peak"] = peak[0]
    out["by_phase"], out["memory"] = ledger.last_step_by_phase(), dmuon.memory_report(model, opt)
    out["expert_resident"] = sum(resident_bytes(b) for b in dmuon.get_state(model).boundaries
                                 if b.ctx is dmuon.get_state(model).expert_ctx)
    return {**out, "full": dmuon.full_state_dict(model), "plan": plan.to_dict(),
            "table": plan.table(), "norms": norms,
            "local_experts": [layer.experts.up.shape[0] for layer in model.layers]}


@functools.cache
def trained(layout_id: str, path=None):
    return run(_train, layout_id, path, SAVE_AT if path else None, world_size=4)


@pytest.mark.parametrize("layout_id", ["ep2x2", "ep4", "hsdp2x2_ep2", "tp1x2x2_ep2"])
def test_expert_parallel_training_matches_the_float64_reference(layout_id):
    ref, norms = reference()
    for rank, res in enumerate(trained(layout_id)):
        assert res["local_experts"] == [E // LAYOUTS[layout_id][2]] * LAYERS
        assert res["norms"] == pytest.approx(norms, rel=1e-9, abs=0), (layout_id, rank)
        assert set(res["full"]) == set(ref)
        for key, value in ref.items():
            err = ((res["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (layout_id, rank, key, err)


def test_the_banned_expert_changes_the_reference():
    """The forced step matters: expert 5, left alone at it, ends elsewhere than in a run
    where it takes tokens (the runs above match the banned one)."""
    banned, _ = reference(banned=True)
    free, _ = reference(banned=False)
    for i in range(LAYERS):
        key = f"layers.{i}.experts.up"
        assert not torch.allclose(banned[key][BANNED], free[key][BANNED], rtol=1e-6)


@pytest.mark.parametrize("other, layout_id", [("ep2x2_z2", "ep2x2"),
                                               ("hsdp2x2_ep2_sync", "hsdp2x2_ep2")])
def test_z2_equals_z3_and_sync_equals_async_bitwise(other, layout_id):
    for a, b in zip(trained(other), trained(layout_id)):
        for key, value in b["full"].items():
            assert torch.equal(a["full"][key], value), key


@pytest.mark.parametrize("layout_id", ["ep2x2", "ep4", "hsdp2x2_ep2"])
def test_experts_are_owned_inside_their_ep_coordinate(layout_id):
    R, N, P, _ = LAYOUTS[layout_id]
    plan = trained(layout_id)[0]["plan"]
    assert plan["ep_size"] == P
    for unit, a in plan["params"].items():
        if a["ep"] is None:
            continue
        lo, hi = a["experts"]
        assert a["ep"] * E // P <= lo < hi <= (a["ep"] + 1) * E // P, unit
        assert a["owner_coord"][1] % P == a["ep"], unit
    assert " ep " in trained(layout_id)[0]["table"].splitlines()[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of EP 2 x expert shard 2 after SAVE_AT steps: one key per expert."""
    path = str(tmp_path_factory.mktemp("ep") / "ckpt")
    return path, trained("ep2x2", path)


@pytest.mark.parametrize("layout_id", ["ep1", "ep4"])
def test_an_ep2_checkpoint_loads_bitwise_on_ep1_and_ep4_and_trains_on(saved, layout_id):
    path, on_ep2 = saved
    ref, norms = reference()
    for rank, res in enumerate(run(_train, layout_id, path, None, True, world_size=4)):
        for key, value in on_ep2[0]["saved"].items():
            assert torch.equal(res["loaded"][key], value), (layout_id, rank, key)
        assert res["norms"] == pytest.approx(norms[SAVE_AT:], rel=1e-9, abs=0)
        for key, value in ref.items():
            err = ((res["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (layout_id, rank, key, err)


def test_the_checkpoint_has_one_key_per_expert(saved):
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(saved[0]).read_metadata().state_dict_metadata)
    for i in range(LAYERS):
        for name in ("up", "down"):
            fqn = f"layers.{i}.experts.{name}"
            assert {k for k in keys if k.startswith(f"model/{fqn}[")} == \
                {f"model/{fqn}[{e}]" for e in range(E)}, sorted(keys)[:20]


def test_the_ledger_counts_expert_gathers_in_their_shard_group_and_tokens_on_ep():
    """EP 2 x expert shard 2, Z3, the last step. ``shard``: the seeds' formula, (n-1)/n of
    what is gathered (and reduced), once for the dense matrices over the 4-rank shard
    group and once for this rank's E/P experts over its 2-rank expert shard group.
    ``ep``, summed over the ranks (one rank's depends on its routing): per layer and
    rank the E int64 counts, then each token's K rows out and back in the forward, and
    their gradients in the backward, (P-1)/P of each."""
    R, N, P, _ = LAYOUTS["ep2x2"]
    dense, experts = LAYERS * D * D, LAYERS * 2 * H * D * E // P
    m = N // P
    shard = Fraction(N - 1, N) * dense * 8 + Fraction(m - 1, m) * experts * 8
    tokens = ROWS * 8  # every rank's tokens, 8 positions a row
    rows = Fraction(P - 1, P) * 2 * K * tokens * D * 8
    counts = Fraction(P - 1, P) * 4 * E * 8
    results = trained("ep2x2")
    for res in results:
        for phase in ("forward", "backward", "reduce"):
            assert res["ledger"][("shard", phase)] == shard, (phase, res["ledger"])
    for phase, want in (("forward", LAYERS * (counts + rows)), ("backward", LAYERS * rows)):
        assert sum(res["ledger"][("ep", phase)] for res in results) == want, phase


def test_a_ranks_expert_storage_stays_within_one_layers_experts_and_its_share():
    """EP 2 x expert shard 2, Z3: the expert buffers alive at once never hold more than
    one layer's E/P experts (the packed buffer is let go once they are copied out),
    beside the rank's own column of them."""
    R, N, P, _ = LAYOUTS["ep2x2"]
    layer = 2 * H * D * E // P * 8
    for res in trained("ep2x2"):
        assert 0 < res["expert_peak"] <= layer, (res["expert_peak"], layer)
        assert res["expert_resident"] == LAYERS * layer * P // N, res["expert_resident"]


@pytest.mark.parametrize("layout_id", ["ep2x2", "hsdp2x2_ep2", "ep2x2_z2"])
def test_the_planners_predictions_are_what_each_rank_measured(layout_id):
    """``dmuon.planning``'s bytes per step on the shard and replicate dims (the step's
    flags aside: the test clips) and resident memory, from the plan alone."""
    from dmuon import planning

    z3 = LAYOUTS[layout_id][3]
    for rank, res in enumerate(trained(layout_id)):
        plan = planning.DedicationPlan.from_dict(res["plan"])
        predicted = planning.ledger_prediction(plan, rank, z3=z3, param_bytes=8,
                                               reduce_bytes=8)
        for dim, phases in predicted.items():
            want = {k: v for k, v in phases.items() if k != "step"}
            got = {k: v for k, v in res["by_phase"][dim].items() if k != "step"}
            assert got == want, (layout_id, rank, dim)
        memory = planning.memory_prediction(plan, rank, z3=z3, param_bytes=8,
                                            master_bytes=8)
        assert {k: res["memory"][k] for k in memory} == memory, (layout_id, rank)


def test_a_planner_partitions_the_whole_meta_model_as_the_ranks_did():
    """``dmuon.partition(experts=..., ep_size=2)`` on a model no rank has cut (a
    planner's) gives the plan every rank of EP 2 x expert shard 2 made after
    ``shard_experts``; without ``experts`` the same call plans EP 1."""
    with torch.device("meta"):
        model = net().double()
    kwargs = {"predicate": is_muon, "shard_size": 4, "hook_boundary_predicate": is_boundary}
    plan = dmuon.partition(model, experts=lambda n, p: ".experts." in n, ep_size=2, **kwargs)
    for res in trained("ep2x2"):
        assert plan.to_dict() == res["plan"]
    assert dmuon.partition(model, **kwargs).ep_size == 1


def _warmed_groups(rank, world, layout_id):
    from helpers.collectives import CollectiveRecorder

    with CollectiveRecorder() as recorder:
        _, model = _setup(LAYOUTS[layout_id])
    warmed = [c.ranks for c in recorder.calls if c.op == "all_reduce" and c.numel == 1]
    return warmed, dmuon.communicator_report(model)


@pytest.mark.parametrize("layout_id", ["hsdp2x2_ep2", "ep4"])
def test_every_group_dmuon_makes_is_warmed_at_set_up_in_one_order(layout_id):
    """Each group DMuon makes (the EP dispatch group, the shard and replicate copies, the
    expert shard copies and the EP group) gets one tiny all-reduce at set-up, on each of
    its members, in creation order: the same order of names on every rank, and the count
    the planner's formula gives."""
    from dmuon.process_groups import COMMUNICATOR_BYTES, communicators_per_rank

    R, N, P, _ = LAYOUTS[layout_id]
    results = run(_warmed_groups, layout_id, world_size=4)
    names = [[n for n, _ in report["groups"]] for _, report in results]
    for rank, (warmed, report) in enumerate(results):
        assert rank in warmed[0] and len(warmed[0]) == P, rank  # the dispatch group first
        assert warmed[1:] == [tuple(r) for _, r in report["groups"]], rank
        assert all(rank in ranks for ranks in warmed), rank
        assert report["count"] == communicators_per_rank(R, P), rank
        assert report["estimated_bytes"] == report["count"] * COMMUNICATOR_BYTES
        assert names[rank] == names[0], rank
    assert names[0][:2] == ["shard:0", "shard:1"] and names[0][-1] == "ep"
