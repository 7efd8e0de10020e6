"""Pieces of the reference guides' examples for the tests that mirror them
(tests/core/test_guides_*.py): the quickstart's ``TinyMLP`` as the guide writes it, and a
float64 single-process reference (torch.optim.Muon + AdamW) with dmuon.Muon's defaults
here, no LR schedule (the guides use none)."""

from __future__ import annotations

import torch
import torch.nn as nn

from helpers.model import build_model, get_config
from helpers.train import global_batches, loss_of, reference_ns


class TinyMLP(nn.Module):
    """getting-started/quickstart.md, "Step 2", model.py: the guide's model, verbatim."""

    def __init__(self, d: int = 512, ff: int = 2048, n_layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([
            nn.ModuleDict({
                "gate_proj": nn.Linear(d, ff, bias=False),
                "up_proj": nn.Linear(d, ff, bias=False),
                "down_proj": nn.Linear(ff, d, bias=False),
                "ln": nn.LayerNorm(d),
            })
            for _ in range(n_layers)
        ])
        self.head = nn.Linear(d, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer["ln"](x)
            x = x + layer["down_proj"](layer["gate_proj"](h) * layer["up_proj"](h))
        return self.head(x).sum()


class Block(nn.ModuleDict):
    """One of TinyMLP's layers with the guide's keys and a forward of its own: FSDP2
    (torch 2.x here) refuses ``fully_shard`` on a container without one, which the
    guide's ``nn.ModuleDict`` layers are."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self["ln"](x)
        return x + self["down_proj"](self["gate_proj"](h) * self["up_proj"](h))


class TinyMLPBlocks(TinyMLP):
    """TinyMLP with the same FQNs, shapes and initialisation (same seed, same values),
    each layer a ``Block`` that FSDP2 can wrap."""

    def __init__(self, d: int = 512, ff: int = 2048, n_layers: int = 4):
        super().__init__(d, ff, n_layers)
        self.layers = nn.ModuleList([Block(dict(layer)) for layer in self.layers])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).sum()


def proj_predicate(n: str, p) -> bool:
    """The guides' predicate: ``lambda n, p: "proj" in n and p.ndim == 2``."""
    return "proj" in n and p.ndim == 2


def torch_optimizers(groups, is_muon=proj_predicate, *, lr=0.02, momentum=0.95,
                     nesterov=True, weight_decay=0.0, ns_steps=5, adamw_lr=1e-3,
                     adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.0):
    """torch.optim.Muon + AdamW with dmuon.Muon's keywords and its defaults here
    (docs/migration.md: torch's update rule, AdamW betas (0.9, 0.95), no AdamW decay).
    ``groups``: a model (split by ``is_muon``) or ``(muon_groups, adamw_groups)``."""
    if isinstance(groups, nn.Module):
        named = list(groups.named_parameters())
        groups = ([p for n, p in named if is_muon(n, p)],
                  [p for n, p in named if not is_muon(n, p)])
    muon, adamw = groups
    return [torch.optim.Muon(muon, lr=lr, momentum=momentum, nesterov=nesterov,
                             weight_decay=weight_decay, ns_steps=ns_steps),
            torch.optim.AdamW(adamw, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                              weight_decay=adamw_weight_decay)]


def one_process(model, opts, losses, steps: int, before_step=None):
    """``steps`` steps of ``opts`` in one process, Newton-Schulz in float64;
    ``losses(model, step)`` gives the step's loss, ``before_step(model)`` runs between
    backward and step (clipping). Returns the final state dict and the losses."""
    seen = []
    with reference_ns():
        for step in range(steps):
            for o in opts:
                o.zero_grad()
            loss = losses(model, step)
            loss.backward()
            if before_step is not None:
                before_step(model)
            for o in opts:
                o.step()
            seen.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, seen


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest error relative to the reference's largest entry."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-300)).item()


def assert_matches(full: dict, ref: dict, tol: float = 1e-9) -> None:
    assert set(full) == set(ref)
    for key, value in ref.items():
        assert rel(full[key], value) <= tol, key


def names_of(model) -> dict:
    """id(param) -> its FQN."""
    return {id(p): n for n, p in model.named_parameters()}


def tiny():
    """The tests' tiny Llama-style model in float64, seed 0."""
    return build_model(get_config("tiny"), dtype=torch.float64, seed=0)


def global_loss(batches, scale: float = 1.0):
    """``losses`` for ``one_process``: the whole global batch of each step."""
    return lambda model, step: loss_of(model, batches[step]) * scale


def two_step_reference(predicate=proj_predicate, config="tiny"):
    """Two steps of ``global_batches(2)`` with ``dmuon.Muon(model, lr=0.02,
    adamw_lr=1e-3)``'s equivalent, Muon on the params ``predicate`` selects."""
    model = build_model(get_config(config), dtype=torch.float64, seed=0)
    opts = torch_optimizers(model, predicate, lr=0.02, adamw_lr=1e-3)
    return one_process(model, opts, global_loss(global_batches(2)), 2)[0]
