"""What the MoE experts' backward writes, counted on the CPU: the built-in ``Experts`` and
Hugging Face's ``Qwen3MoeExperts`` (a tiny ``Qwen3MoeConfig``), E = 8 and E = 32 experts,
EP 1 in one process (as the worker runs them: ``use_expert_parallel`` with no EP group)
and EP 2 on 2 gloo ranks, float64.

A dispatch mode sums the bytes of every tensor an op writes during ``backward()`` (its
outputs that are not views: new tensors and in-place results). The experts' weights
cost what that sum grows by when they need a gradient (the same backward with them
frozen writes the activations' gradients only); it must stay within 4 P, P being the
bytes of this rank's expert weights: a gradient per weight plus the grouped layout's
copy, where a select per expert writes a whole zero tensor per expert (E x P).
The loss and every gradient match a per-expert loop written here within 1e-12."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dmuon.testing import run
from service.job.models.builtin import Experts
from service.job.models.experts import use_expert_parallel
from service.job.spec.presets import ModelConfig

D, F_DIM, K, N = 32, 16, 2, 16
BOUND = 4  # x P
TOL = 1e-12


class WrittenBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, tuple) else (out,)
        for ret, value in zip(func._schema.returns, outs):
            if ret.alias_info is not None and not ret.alias_info.is_write:
                continue  # a view of an input: nothing written
            self.bytes += sum(t.nbytes for t in tree_flatten(value)[0]
                              if isinstance(t, torch.Tensor))
        return out


def _module(kind: str, E: int) -> nn.Module:
    """The experts, float64, weights drawn from a fixed seed."""
    if kind == "builtin":
        c = ModelConfig(vocab_size=64, dim=D, n_layers=1, n_heads=4, n_kv_heads=2,
                        ffn_dim=32, max_seq_len=16, experts=E, top_k=K, moe_ffn_dim=F_DIM)
        module = Experts(c)
    else:
        import transformers
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F_DIM,
                                             num_experts=E, num_experts_per_tok=K)
        config._experts_implementation = "eager"  # the worker's choice for float64
        module = Qwen3MoeExperts(config)
    module = module.double()
    g = torch.Generator().manual_seed(E)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2)
    return module


def _cut(module: nn.Module, rank: int, P: int) -> None:
    """This EP rank's E/P experts, as ``dmuon.shard_experts`` leaves them."""
    for name, p in list(module.named_parameters(recurse=False)):
        per = p.shape[0] // P
        setattr(module, name, nn.Parameter(p.detach()[rank * per:(rank + 1) * per].clone()))


def _inputs(rank: int, E: int):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    logits = torch.randn(N, E, generator=g, dtype=torch.float64)
    weights, choices = logits.softmax(-1).topk(K, dim=-1)
    return x, choices, weights, torch.randn(N, D, generator=g, dtype=torch.float64)


def _expert(kind: str, params: dict, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` on rows ``x``, written from the layouts' definitions."""
    if kind == "builtin":
        h = F.silu(x @ params["gate_proj"][e].T) * (x @ params["up_proj"][e].T)
    else:
        gate, up = (x @ params["gate_up_proj"][e].T).chunk(2, dim=-1)
        h = F.silu(gate) * up
    return h @ params["down_proj"][e].T


def reference(kind: str, E: int, ranks: int) -> dict:
    """Every rank's tokens through their experts in a per-expert loop; the loss summed."""
    module = _module(kind, E)
    params = dict(module.named_parameters())
    xs, ws, loss = [], [], 0
    for r in range(ranks):
        x, choices, weights, target = _inputs(r, E)
        x.requires_grad_(True)
        weights.requires_grad_(True)
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (choices == e).nonzero(as_tuple=True)
            out = out.index_add(0, tok, _expert(kind, params, e, x[tok])
                                * weights[tok, slot, None])
        loss = loss + (out * target).sum()
        xs.append(x)
        ws.append(weights)
    loss.backward()
    return {"loss": loss.item(), "x": [x.grad for x in xs], "weights": [w.grad for w in ws],
            "params": {n: p.grad for n, p in params.items()}}


def _backward(module, rank: int, E: int, expert_grads: bool) -> dict:
    x, choices, weights, target = _inputs(rank, E)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    for p in module.parameters():
        p.grad = None
        p.requires_grad_(expert_grads)
    loss = (module(x, choices, weights) * target).sum()
    with WrittenBytes() as written:
        loss.backward()
    return {"bytes": written.bytes, "loss": loss.item(), "x": x.grad,
            "weights": weights.grad, "params": {n: p.grad for n, p in
                                                module.named_parameters()}}


def measure(rank: int, P: int, kind: str, E: int) -> dict:
    """This rank's backward, its bytes over its expert weights' P, and its gradients."""
    holder = nn.Module()
    holder.experts = _module(kind, E)
    if P > 1:
        _cut(holder.experts, rank, P)
    use_expert_parallel(holder, dist.group.WORLD if P > 1 else None)
    weight_bytes = sum(p.nbytes for p in holder.experts.parameters())
    frozen = _backward(holder.experts, rank, E, expert_grads=False)
    res = _backward(holder.experts, rank, E, expert_grads=True)
    return {**res, "ratio": (res["bytes"] - frozen["bytes"]) / weight_bytes}


def _ep_worker(rank, world, cases):
    return {case: measure(rank, world, *case) for case in cases}


CASES = [(kind, E) for kind in ("builtin", "qwen3_moe") for E in (8, 32)]


@functools.cache
def ep2() -> list:
    return run(_ep_worker, CASES, world_size=2)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _check(res: dict, ref: dict, rank: int, P: int, E: int) -> None:
    assert _rel(res["x"], ref["x"][rank]) <= TOL
    assert _rel(res["weights"], ref["weights"][rank]) <= TOL
    per = E // P
    for name, grad in res["params"].items():
        want = ref["params"][name][rank * per:(rank + 1) * per]
        assert _rel(grad, want) <= TOL, name


@pytest.mark.parametrize("kind, E", CASES)
def test_ep1_experts_backward_writes_at_most_4p(kind, E):
    res = measure(0, 1, kind, E)
    assert res["ratio"] <= BOUND, res["ratio"]
    ref = reference(kind, E, 1)
    assert abs(res["loss"] - ref["loss"]) <= TOL * abs(ref["loss"])
    _check(res, ref, 0, 1, E)


@pytest.mark.parametrize("kind, E", CASES)
def test_ep2_experts_backward_writes_at_most_4p(kind, E):
    results = [r[(kind, E)] for r in ep2()]
    ref = reference(kind, E, 2)
    assert abs(sum(r["loss"] for r in results) - ref["loss"]) <= TOL * abs(ref["loss"])
    for rank, res in enumerate(results):
        assert res["ratio"] <= BOUND, (rank, res["ratio"])
        _check(res, ref, rank, 2, E)


def test_the_counter_sees_a_select_per_expert():
    """The count can fail: a select per expert writes E whole-weight zero tensors."""
    w = torch.zeros(8, 4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.ones(1, 4, dtype=torch.float64)
    loss = sum((x @ w[e].T).sum() for e in range(8))
    with WrittenBytes() as written:
        loss.backward()
    assert written.bytes >= 8 * w.nbytes
