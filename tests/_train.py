"""Shared pieces of the distributed tests: data, the DMuon training run, the float64
single-process reference built from torch.optim.Muon + AdamW."""

from __future__ import annotations

import torch

import dmuon
from service.models import build_model, causal_lm_loss, get_config, muon_predicate

SEQ, GLOBAL_BATCH = 16, 8
HPARAMS = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adamw_lr=3e-3,
               adamw_betas=(0.9, 0.95), adamw_eps=1e-8, adamw_weight_decay=0.05)


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.1 * step)


def global_batches(steps: int, vocab: int = 256):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def local_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = batch.shape[0] // world
    return batch[rank * per:(rank + 1) * per]


def loss_of(model, tokens):
    return causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])


def fp64_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    """An independent float64 NS (plain matmuls, no addmm) for the reference."""
    a, b, c = ns_coefficients
    x = grad.to(torch.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def reference_run(steps: int, adjust_lr_fn=None, batches=None, config="tiny"):
    """Single process, whole global batch: torch.optim.Muon with a float64 NS + AdamW."""
    import torch.optim._muon as tmuon

    model = build_model(get_config(config), dtype=torch.float64, seed=0)
    muon_params = [p for n, p in model.named_parameters() if muon_predicate(n, p)]
    others = [p for n, p in model.named_parameters() if not muon_predicate(n, p)]
    h = HPARAMS
    muon = torch.optim.Muon(muon_params, lr=h["lr"], weight_decay=h["weight_decay"],
                            momentum=h["momentum"], nesterov=h["nesterov"],
                            adjust_lr_fn=adjust_lr_fn)
    adamw = torch.optim.AdamW(others, lr=h["adamw_lr"], betas=h["adamw_betas"],
                              eps=h["adamw_eps"], weight_decay=h["adamw_weight_decay"])
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in (muon, adamw)]
    saved = tmuon._zeropower_via_newtonschulz
    tmuon._zeropower_via_newtonschulz = fp64_newton_schulz
    losses = []
    try:
        for batch in batches or global_batches(steps):
            loss = loss_of(model, batch)
            loss.backward()
            muon.step()
            adamw.step()
            for s in scheds:
                s.step()
            muon.zero_grad()
            adamw.zero_grad()
            losses.append(loss.item())
    finally:
        tmuon._zeropower_via_newtonschulz = saved
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def build_dmuon(mesh, z3: bool, *, replicate_mesh=None, fsdp_mesh=None, config="tiny",
                dtype=torch.float64, **muon_kwargs):
    """Built-in model with DMuon then FSDP2 applied, and its optimizer."""
    from torch.distributed.fsdp import fully_shard

    model = build_model(get_config(config), dtype=dtype, seed=0)
    dmuon.dedicate_params(model, mesh, predicate=muon_predicate, replicate_mesh=replicate_mesh,
                          reshard_after_forward=z3)
    fsdp_mesh = fsdp_mesh or mesh
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3)
    kwargs = {**HPARAMS, "ns_dtype": dtype, **muon_kwargs}
    return model, dmuon.Muon(model, **kwargs)
