"""Unused and conditional parameters: a 2-D branch that runs on some ranks at some steps
(on none at some), and a routed MoE whose experts get no tokens on some ranks. Every rank
must issue the same collectives, a missing gradient counts as zero, and a matrix no rank
touched is skipped as ``torch.optim`` skips a param without ``.grad``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.collectives import CollectiveRecorder
from helpers.train import HPARAMS, reference_ns, reference_optimizers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

D, H, VOCAB, E, LAYERS, STEPS, WORLD, ROWS = 16, 24, 64, 4, 2, 10, 4, 3
# which ranks run the branch at each step: all, none, some
BRANCH = [(1, 1, 1, 1), (0, 0, 0, 0), (1, 0, 0, 1), (0, 1, 0, 0), (1, 1, 0, 1),
          (0, 0, 0, 0), (0, 0, 1, 0), (1, 1, 1, 1), (1, 0, 1, 0), (0, 0, 0, 1)]


class BranchLayer(nn.Module):
    """The branch runs when the micro-batch's first token is odd: a data-dependent,
    per-rank decision inside one hook boundary."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.branch = nn.Linear(D, D, bias=False)
        self.mlp_in, self.mlp_out = nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)

    def forward(self, x, tokens):
        if tokens[0, 0] % 2:
            x = x + self.branch(self.norm(x))
        return x + self.mlp_out(F.silu(self.mlp_in(self.norm(x))))


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class MoELayer(nn.Module):
    """Top-1 routing over per-expert matrices: an expert without tokens on a rank never
    runs there, so its matrices get no gradient on that rank."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x, tokens):
        h = self.norm(x).reshape(-1, D)
        probs = self.router(h).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = choice == e
            if mask.any():
                out[mask] = expert(h[mask]) * probs[mask, e:e + 1]
        return x + out.view_as(x)


class Net(nn.Module):
    def __init__(self, layer_cls):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(layer_cls() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB, bias=False)

        self.skip_last = False  # the last block sits out (on every rank)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers[:-1] if self.skip_last else self.layers:
            h = layer(h, tokens)
        return self.head(h)


def build(kind: str) -> Net:
    torch.manual_seed(0)
    return Net(MoELayer if kind == "moe" else BranchLayer).double()


def skips(kind: str, step: int) -> bool:
    """"skip": the last block (a whole hook boundary) sits out every third step, while
    the HSDP replicate all-gather of its last update may still be in flight."""
    return kind == "skip" and step % 3 == 1


def is_muon(name, p):
    return name.startswith("layers.") and p.ndim == 2 and "router" not in name


def batches(kind: str):
    """Each rank's rows; for the branch model the first token's parity follows BRANCH."""
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(STEPS):
        batch = torch.randint(0, VOCAB, (WORLD * ROWS, 9), generator=g)
        if kind == "branch":
            for rank, used in enumerate(BRANCH[step]):
                batch[rank * ROWS, 0] = 2 * (batch[rank * ROWS, 0] // 2) + used
        out.append(batch)
    return out


def loss_of(model, rows):
    logits = model(rows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))


def _train(rank, world, kind, layout, z3):
    R, N = layout
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    model = build(kind)
    dmuon.dedicate_params(model, mesh["shard"], predicate=is_muon, reshard_after_forward=z3,
                          replicate_mesh=mesh["replicate"] if R > 1 else None)
    fsdp_mesh = mesh if R > 1 else mesh["shard"]
    for layer in model.layers:
        dmuon.fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3)
    dmuon.fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    sequence, idle, presence = [], 0, dmuon.get_state(model).reduce.agreement.presence
    with CollectiveRecorder() as rec:
        for step, batch in enumerate(batches(kind)):
            model.skip_last = skips(kind, step)
            loss_of(model, batch[rank * ROWS:(rank + 1) * ROWS]).backward()
            idle += int((presence == 0).sum())  # matrices without a gradient on this rank
            opt.step()
            opt.zero_grad()
            sequence.append([(c.op, c.numel, c.ranks) for c in rec.take()])
    return {"full": dmuon.full_state_dict(model), "sequence": sequence, "idle": idle}


@functools.cache
def reference(kind: str):
    """One process: the mean of the ranks' losses, each rank's rows taking its own path,
    so a matrix no rank used has no gradient and torch.optim skips it."""
    model = build(kind)
    muon = [p for n, p in model.named_parameters() if is_muon(n, p)]
    opts = reference_optimizers(muon, [p for n, p in model.named_parameters()
                                       if not is_muon(n, p)])
    untouched = 0
    with reference_ns():
        for step, batch in enumerate(batches(kind)):
            model.skip_last = skips(kind, step)
            sum(loss_of(model, batch[r * ROWS:(r + 1) * ROWS]) for r in range(WORLD)).__truediv__(
                WORLD).backward()
            untouched += sum(p.grad is None for p in muon)
            for o in opts:
                o.step()
                o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, untouched


CASES = [("branch", (1, 4), True), ("branch", (2, 2), False), ("moe", (1, 4), True),
         ("moe", (2, 2), False), ("skip", (2, 2), True)]


@pytest.mark.parametrize("kind,layout,z3", CASES,
                         ids=["branch-z3", "branch-hsdp2x2-z2", "moe-z3", "moe-hsdp2x2-z2",
                              "skipped-block-hsdp2x2-z3"])
def test_conditional_params_match_the_reference(kind, layout, z3):
    ref, untouched = reference(kind)
    results = run(_train, kind, layout, z3, world_size=WORLD)
    assert sum(r["idle"] for r in results) > 0  # some matrices idle on some ranks
    if kind != "moe":
        assert untouched > 0  # and at some steps on every rank
    for rank, res in enumerate(results):
        for key, value in ref.items():
            err = ((res["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (rank, key, err)
    # every rank of a group issued the same collectives on it, step by step
    for step in range(STEPS):
        by_group = {}
        for res in results:
            for op, numel, ranks in res["sequence"][step]:
                by_group.setdefault(ranks, []).append((op, numel))
        for ranks, calls in by_group.items():
            per_rank = len(calls) // len(ranks)
            assert len(calls) == per_rank * len(ranks), (step, ranks)


# -- Z3: a boundary whose inputs need no grad, a param unused on one rank, accumulation ----
MICRO, ACCUM_STEPS = 2, 3


def accumulation_rows(step_batch: torch.Tensor, rank: int, micro: int) -> torch.Tensor:
    lo = (micro * WORLD + rank) * ROWS
    return step_batch[lo:lo + ROWS]


def accumulation_batches():
    """Two micro-batches per step; the branch is off on rank 1 only, in the first."""
    g = torch.Generator().manual_seed(13)
    out = []
    for _ in range(ACCUM_STEPS):
        batch = torch.randint(0, VOCAB, (MICRO * WORLD * ROWS, 9), generator=g)
        for micro in range(MICRO):
            for rank in range(WORLD):
                used = 0 if (micro, rank) == (0, 1) else 1
                row = (micro * WORLD + rank) * ROWS
                batch[row, 0] = 2 * (batch[row, 0] // 2) + used
        out.append(batch)
    return out


def build_frozen_embedding() -> Net:
    """The first block's inputs need no grad: its backward ends with its last param's
    gradient, not at a function on its inputs."""
    model = build("branch")
    model.embed.weight.requires_grad_(False)
    return model


def _train_accumulating(rank, world):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_frozen_embedding()
    dmuon.dedicate_params(model, mesh, predicate=is_muon)
    for layer in model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    for batch in accumulation_batches():
        for micro in range(MICRO):
            (loss_of(model, accumulation_rows(batch, rank, micro)) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return dmuon.full_state_dict(model)


def test_z3_boundary_without_input_grads_and_a_rank_local_unused_param_accumulates():
    """On the rank without the branch's gradient the first block never saw all its
    gradients; it must still end (freed, reduced) at the end of the backward like on its
    peers, or the next micro-batch's forward issues a gather there that its peers skip."""
    model = build_frozen_embedding()
    muon = [p for n, p in model.named_parameters() if is_muon(n, p)]
    opts = reference_optimizers(muon, [p for n, p in model.named_parameters()
                                       if not is_muon(n, p) and p.requires_grad])
    with reference_ns():
        for batch in accumulation_batches():
            losses = [loss_of(model, accumulation_rows(batch, r, k))
                      for k in range(MICRO) for r in range(WORLD)]
            (sum(losses) / len(losses)).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    ref = model.state_dict()
    for rank, full in enumerate(run(_train_accumulating, world_size=WORLD)):
        for key, value in ref.items():
            err = ((full[key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (rank, key, err)


def _collective_order(rank, world):
    from helpers.collectives import CollectiveRecorder

    with CollectiveRecorder() as recorder:
        result = _train_accumulating(rank, world)
    return result, [(c.op, c.ranks, c.numel) for c in recorder.calls]


def test_every_rank_issues_every_collective_in_one_order():
    """The scenario above, every collective recorded by wrapping torch.distributed:
    DMuon's and FSDP2's (different communicators). The first block ends without a
    function on its inputs; where that end depended on the rank's gradients, rank 1 sent
    DMuon's reduce after FSDP2's collectives and its peers before, which NCCL may hang on
    (one order across communicators). The same sequence on every rank, same result."""
    results = run(_collective_order, world_size=WORLD)
    orders = [order for _, order in results]
    assert len(orders[0]) > 0
    for rank, order in enumerate(orders[1:], start=1):
        assert order == orders[0], rank
    for rank, (full, _) in enumerate(results[1:], start=1):
        for key, value in results[0][0].items():
            assert torch.equal(full[key], value), (rank, key)
