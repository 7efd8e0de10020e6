"""3-D (experts, out, in) weights: per-slice NS, per-slice lr, owners by slices of experts."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.layer_stack import LayerStack
from helpers.train import HPARAMS, reference_ns, reference_optimizers
from torch import nn

import dmuon
from dmuon.testing import run

E, D, H, VOCAB, STEPS, LAYERS = 8, 16, 32, 64, 6, 2


class ExpertLayer(nn.Module):
    """Every token through every expert, averaged: enough to give each slice a gradient."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.up = nn.Parameter(torch.empty(E, H, D))
        self.down = nn.Parameter(torch.empty(E, D, H))
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        h = F.silu(torch.einsum("btd,ehd->bteh", self.norm(x), self.up))
        return x + self.proj(torch.einsum("bteh,edh->btd", h, self.down) / E)


class LoopLayer(nn.Module):
    """The same layer with one 2-D parameter per expert (the per-expert reference)."""

    def __init__(self, layer: ExpertLayer):
        super().__init__()
        self.norm, self.proj = layer.norm, layer.proj
        self.up = nn.ParameterList([nn.Parameter(w.clone()) for w in layer.up.detach()])
        self.down = nn.ParameterList([nn.Parameter(w.clone()) for w in layer.down.detach()])

    def forward(self, x):
        n = self.norm(x)
        out = sum(F.silu(n @ u.T) @ d.T for u, d in zip(self.up, self.down))
        return x + self.proj(out / E)


def moe() -> LayerStack:
    return LayerStack(ExpertLayer, LAYERS, VOCAB, D)


def build(seed=0) -> LayerStack:
    torch.manual_seed(seed)
    model = moe().double()
    with torch.no_grad():
        for layer in model.layers:
            layer.up.normal_(0, 0.2)
            layer.down.normal_(0, 0.2)
    return model


def is_muon(name, p):
    return name.startswith("layers.") and p.ndim >= 2


def batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (8, 9), generator=g) for _ in range(STEPS)]


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(rank, world, path=None, save_at=None, load=False):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build()
    plan = dmuon.dedicate_params(model, mesh, predicate=is_muon)
    for layer in model.layers:
        dmuon.fully_shard(layer, mesh=mesh)
    dmuon.fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    out, start = {"plan": plan.to_dict()}, 0
    if load:
        start = dmuon.checkpoint.load(path, model, opt)["step"]
        out["loaded"] = dmuon.full_state_dict(model)
    per = 8 // world
    for step, batch in enumerate(batches()):
        if step < start:
            continue
        loss_of(model, batch[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
        if save_at == step + 1:
            dmuon.checkpoint.save(path, model, opt, extra={"step": step + 1})
            out["saved"] = dmuon.full_state_dict(model)
    out["full"] = dmuon.full_state_dict(model)
    return out


def _reference():
    """Single process, one 2-D param per expert, torch.optim.Muon with a float64 NS."""
    model = build()
    model.layers = nn.ModuleList(LoopLayer(layer) for layer in model.layers)
    opts = reference_optimizers([p for n, p in model.named_parameters() if is_muon(n, p)],
                                [p for n, p in model.named_parameters() if not is_muon(n, p)])
    with reference_ns():
        for batch in batches():
            loss_of(model, batch).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    sd = model.state_dict()
    for i in range(LAYERS):
        for name in ("up", "down"):
            sd[f"layers.{i}.{name}"] = torch.stack(
                [sd.pop(f"layers.{i}.{name}.{e}") for e in range(E)])
    return sd


@functools.cache
def four_ranks(path):
    return run(_train, path, 3)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe") / "ckpt")


def test_expert_training_matches_per_expert_loop(path):
    ref = _reference()
    for res in four_ranks(path):
        assert set(res["full"]) == set(ref)
        for key, value in ref.items():
            err = ((res["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (key, err)


def test_eight_experts_balance_over_four_owners_by_slices(path):
    plan = four_ranks(path)[0]["plan"]
    for i in range(LAYERS):
        for name in ("up", "down"):
            units = {u: a for u, a in plan["params"].items() if a["param"] == f"layers.{i}.{name}"}
            assert sorted(a["experts"] for a in units.values()) == [[0, 2], [2, 4], [4, 6], [6, 8]]
            assert sorted(a["owner"] for a in units.values()) == [0, 1, 2, 3]


def test_expert_checkpoint_loads_with_other_slicing(path):
    saved = four_ranks(path)[0]["saved"]  # 4 slices of 2 experts
    for res in run(_train, path, load=True, world_size=2):  # 2 slices of 4 experts
        for key, value in saved.items():
            assert torch.equal(res["loaded"][key], value), key
