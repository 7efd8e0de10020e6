"""Dropless expert dispatch over EP (``dmuon.expert_dispatch``) on 4 gloo ranks, float64.

An MoE layer (E=8 experts, top 2, a softmax router) runs with EP 4: rank p holds experts
2p and 2p+1 and routes its own tokens. Its outputs and the gradients of its inputs, its
router and its local experts are checked against one process evaluating the same experts
densely on every rank's tokens (the loss: the sum over ranks); the ledger's ``ep`` bytes
against a formula written here; the collectives against every other rank's."""

from __future__ import annotations

import functools
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers.collectives import CollectiveRecorder
from torch import nn
from torch.utils.checkpoint import checkpoint

from dmuon.comm import Ledger
from dmuon.expert_dispatch import dispatch_combine
from dmuon.testing import run

D, H, E, K, P, N = 16, 24, 8, 2, 4, 12
TOL = 1e-9
# "forced": no token may pick rank 1's experts (2 and 3), and rank 3 has no token at all
BANNED = (2, 3)
EMPTY_RANK = 3


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def build():
    torch.manual_seed(0)
    return nn.Linear(D, E, bias=False).double(), [Expert().double() for _ in range(E)]


def tokens_and_targets(rank: int, mode: str):
    g = torch.Generator().manual_seed(100 + rank)
    n = 0 if mode == "forced" and rank == EMPTY_RANK else N
    return (torch.randn(n, D, generator=g, dtype=torch.float64),
            torch.randn(n, D, generator=g, dtype=torch.float64))


def route(router, x, mode: str):
    """Top-k of a softmax router; "forced" masks the banned experts' logits first."""
    logits = router(x)
    if mode == "forced":
        banned = torch.zeros(E, dtype=torch.bool)
        banned[list(BANNED)] = True
        logits = logits.masked_fill(banned, float("-inf"))
    weights, choices = logits.softmax(-1).topk(K, dim=-1)
    return weights, choices


def dense_moe(x, weights, choices, experts):
    """The one-process evaluation: every (token, choice) through its expert."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        tok, slot = (choices == e).nonzero(as_tuple=True)
        out = out.index_add(0, tok, expert(x[tok]) * weights[tok, slot].unsqueeze(-1))
    return out


def _grads(module):
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for p in module.parameters()]


def _worker(rank, world, mode, wrap, local_order):
    router, experts = build()
    local = [experts[e] for e in local_order(rank)]
    x, target = tokens_and_targets(rank, mode)
    x.requires_grad_(True)
    ledger, group = Ledger(), dist.group.WORLD

    def layer(x):
        weights, choices = route(router, x, mode)
        return dispatch_combine(x, choices, weights, local, E, group, ledger)

    with CollectiveRecorder() as rec:
        if wrap == "checkpoint":
            out = checkpoint(layer, x, use_reentrant=False)
        else:
            out = (torch.compile(layer) if wrap == "compile" else layer)(x)
        (out * target).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "router_grad": router.weight.grad,
            "expert_grads": {e: _grads(experts[e]) for e in range(rank * 2, rank * 2 + 2)},
            "calls": [(c.op, c.ranks) for c in rec.take()],
            "ledger": {ph: ledger.current("ep", ph)
                       for ph in ("forward", "backward", "recompute")}}


def own_experts(rank):
    return [2 * rank, 2 * rank + 1]


def swapped_experts(rank):
    """A wrong dispatch: each rank's two experts trade places."""
    return [2 * rank + 1, 2 * rank]


@functools.cache
def reference(mode: str):
    router, experts = build()
    outs, xs, choices, loss = [], [], [], 0
    for r in range(P):
        x, target = tokens_and_targets(r, mode)
        x.requires_grad_(True)
        weights, chosen = route(router, x, mode)
        out = dense_moe(x, weights, chosen, experts)
        loss = loss + (out * target).sum()
        outs.append(out.detach())
        xs.append(x)
        choices.append(chosen)
    loss.backward()
    return {"out": outs, "x_grad": [x.grad for x in xs], "router_grad": router.weight.grad,
            "expert_grads": [_grads(e) for e in experts], "choices": choices}


def _rel(a, b) -> float:
    if b.numel() == 0:
        return 0.0 if a.shape == b.shape else float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def worst_error(results, ref) -> float:
    """The largest relative error of any output or gradient against the reference."""
    errs = []
    for r, res in enumerate(results):
        errs += [_rel(res["out"], ref["out"][r]), _rel(res["x_grad"], ref["x_grad"][r])]
        for e, grads in res["expert_grads"].items():
            errs += [_rel(g, want) for g, want in zip(grads, ref["expert_grads"][e])]
    router = sum(res["router_grad"] for res in results)  # each rank: its own tokens' part
    return max(errs + [_rel(router, ref["router_grad"])])


def expected_ep_bytes(ref, rank: int) -> dict[str, Fraction]:
    """The ledger's model, from the reference's routing: (P-1)/P of what this rank puts
    into each all-to-all: E int64 counts, its n*k rows out, the rows it received back."""
    sent = ref["choices"][rank].numel()
    received = sum(int(((c // (E // P)) == rank).sum()) for c in ref["choices"])
    rows = (sent + received) * D * 8
    forward = Fraction(P - 1, P) * (E * 8 + rows)
    return {"forward": forward, "backward": Fraction(P - 1, P) * rows}


@pytest.mark.parametrize("mode", ["router", "forced"])
def test_dispatch_matches_one_process(mode):
    ref = reference(mode)
    results = run(_worker, mode, None, own_experts, world_size=P)
    assert worst_error(results, ref) <= TOL
    if mode == "forced":  # the routing really left an expert and a rank without a row
        everyone = torch.cat(ref["choices"])
        assert not any((everyone == e).any() for e in BANNED)
        assert results[EMPTY_RANK]["out"].shape == (0, D)
        assert all(g.abs().max() == 0 for e in BANNED for g in results[1]["expert_grads"][e])
    # every rank issued the same collectives, whatever it sent or received
    assert all(res["calls"] == results[0]["calls"] for res in results)
    assert [op for op, _ in results[0]["calls"]] == ["all_to_all_single"] * 5
    for rank, res in enumerate(results):
        want = expected_ep_bytes(ref, rank)
        assert res["ledger"] == {**want, "recompute": 0}, rank


def test_a_wrong_dispatch_is_detected():
    """The comparison can fail: with each rank's experts swapped, rows reach the wrong
    expert and the outputs leave the reference far behind."""
    results = run(_worker, "router", None, swapped_experts, world_size=P)
    assert worst_error(results, reference("router")) > 1e-3


def test_dispatch_under_activation_checkpointing():
    """Non-reentrant checkpointing re-runs the dispatch inside the backward: the same
    gradients, the re-run's bytes counted as ``recompute``, the same collectives on every
    rank (three in the forward, three in the recompute, two in the backward)."""
    ref = reference("forced")
    results = run(_worker, "forced", "checkpoint", own_experts, world_size=P)
    assert worst_error(results, ref) <= TOL
    assert all(res["calls"] == results[0]["calls"] for res in results)
    assert len(results[0]["calls"]) == 8
    for rank, res in enumerate(results):
        want = expected_ep_bytes(ref, rank)
        assert res["ledger"] == {**want, "recompute": want["forward"]}, rank


def test_dispatch_in_a_compiled_block():
    """``torch.compile`` of the layer: the dispatch runs eagerly inside it (one graph
    break), with the same results, collectives and bytes as without compile."""
    ref = reference("forced")
    results = run(_worker, "forced", "compile", own_experts, world_size=P)
    assert worst_error(results, ref) <= TOL
    assert all(res["calls"] == results[0]["calls"] for res in results)
    assert len(results[0]["calls"]) == 5
    for rank, res in enumerate(results):
        assert res["ledger"] == {**expected_ep_bytes(ref, rank), "recompute": 0}, rank
