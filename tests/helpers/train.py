"""Shared pieces of the distributed tests: data, the DMuon training run, the float64
single-process reference built from torch.optim.Muon + AdamW."""

from __future__ import annotations

import contextlib

import torch

import dmuon
from helpers.model import build_model, causal_lm_loss, get_config, muon_predicate

SEQ, GLOBAL_BATCH = 16, 16
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


@contextlib.contextmanager
def reference_ns(ns=fp64_newton_schulz):
    """torch.optim.Muon's Newton-Schulz replaced by ``ns(grad, coefficients, steps, eps)``
    (an independent float64 NS by default)."""
    import torch.optim._muon as tmuon

    saved, tmuon._zeropower_via_newtonschulz = tmuon._zeropower_via_newtonschulz, ns
    try:
        yield
    finally:
        tmuon._zeropower_via_newtonschulz = saved


def reference_optimizers(muon, others, adjust_lr_fn=None) -> list:
    """torch.optim.Muon (``muon``: params or param groups) and torch.optim.AdamW with the
    tests' hyperparameters."""
    h = HPARAMS
    return [torch.optim.Muon(muon, lr=h["lr"], weight_decay=h["weight_decay"],
                             momentum=h["momentum"], nesterov=h["nesterov"],
                             adjust_lr_fn=adjust_lr_fn),
            torch.optim.AdamW(others, lr=h["adamw_lr"], betas=h["adamw_betas"],
                              eps=h["adamw_eps"], weight_decay=h["adamw_weight_decay"])]


def per_expert_leaves(model, is_muon) -> tuple[list, list, list]:
    """``(matrices, slices, others)``: the 2-D Muon params, each 3-D Muon param as one 2-D
    leaf per expert ``(param, e, leaf)`` (torch.optim.Muon takes matrices only), and the
    AdamW params."""
    matrices, slices, others = [], [], []
    for name, p in model.named_parameters():
        if not is_muon(name, p):
            others.append(p)
        elif p.ndim == 2:
            matrices.append(p)
        else:
            slices += [(p, e, torch.nn.Parameter(p.detach()[e].clone())) for e in range(len(p))]
    return matrices, slices, others


def step_per_expert(opts, slices) -> None:
    """Step ``opts``, each expert's slice through its leaf: its gradient in, its value
    copied back."""
    for p, e, leaf in slices:
        leaf.grad = p.grad[e].clone()
    for o in opts:
        o.step()
    with torch.no_grad():
        for p, e, leaf in slices:
            p[e].copy_(leaf)


def reference_train(model, opts, batches, loss=None,
                    ns=fp64_newton_schulz) -> tuple[dict, list[float]]:
    """Train ``model`` in one process with ``opts`` (each under the tests' LR schedule),
    Newton-Schulz in float64 (``ns``); returns its final state dict and the losses.
    ``loss(model, batch)``: the built-in model's next-token loss unless given."""
    loss = loss or loss_of
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in opts]
    losses = []
    with reference_ns(ns):
        for batch in batches:
            value = loss(model, batch)
            value.backward()
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
            for o in opts:
                o.zero_grad()
            losses.append(value.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def reference_run(steps: int, adjust_lr_fn=None, batches=None, config="tiny",
                  ns=fp64_newton_schulz):
    """Single process, whole global batch: torch.optim.Muon with a float64 NS + AdamW."""
    model = build_model(get_config(config), dtype=torch.float64, seed=0)
    opts = reference_optimizers([p for n, p in model.named_parameters() if muon_predicate(n, p)],
                                [p for n, p in model.named_parameters()
                                 if not muon_predicate(n, p)], adjust_lr_fn)
    return reference_train(model, opts, batches or global_batches(steps), ns=ns)


def build_dmuon(mesh, z3: bool, *, replicate_mesh=None, fsdp_mesh=None, config="tiny",
                dtype=torch.float64, prefetch=1, prepare=None, **muon_kwargs):
    """Built-in model with DMuon then FSDP2 applied, and its optimizer; ``prepare``
    changes the model first (activation checkpointing, say)."""
    model = build_model(get_config(config), dtype=dtype, seed=0)
    if prepare is not None:
        model = prepare(model)
    dmuon.dedicate_params(model, mesh, predicate=muon_predicate, replicate_mesh=replicate_mesh,
                          reshard_after_forward=z3, prefetch=prefetch)
    fsdp_mesh = fsdp_mesh or mesh
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3)
    dmuon.fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=z3)
    kwargs = {**HPARAMS, "ns_dtype": dtype, **muon_kwargs}
    return model, dmuon.Muon(model, **kwargs)


def optimizer_snapshot(model, opt) -> dict:
    """This rank's owned momentum plus every AdamW tensor in full (collective)."""
    state = dmuon.get_state(model)
    snap = {f"momentum/{fqn}": opt.state[p]["momentum_buffer"].clone()
            for fqn, p in state.owned_params.items() if "momentum_buffer" in opt.state[p]}
    for name, p in model.named_parameters():
        for key, value in opt.state.get(p, {}).items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            # clone: on a size-1 shard dim full_tensor() is the live local tensor
            snap[f"adamw/{name}/{key}"] = full.clone()
    return snap


def hsdp_train(rank, world, layout, *, z3=True, steps=10, replicate_async=True, save_at=None,
               path=None, load=False, micro=1, clip=None, accumulate="no_sync"):
    """Train on an R x N layout; optionally save after ``save_at`` steps or resume.
    ``micro`` micro-batches per step, each weighted by its share of the rows, accumulated
    under ``no_sync`` or (``accumulate="backward"``) by plain repeated backward."""
    from torch.distributed.device_mesh import init_device_mesh

    R, N = layout
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    model, opt = build_dmuon(mesh["shard"], z3, replicate_mesh=mesh["replicate"],
                             fsdp_mesh=mesh, replicate_async=replicate_async)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    out, start = {"losses": [], "norms": []}, 0
    if load:
        extra = dmuon.checkpoint.load(path, model, opt)
        start = extra["step"]
        sched.load_state_dict(extra["sched"])
        out["loaded"] = {**dmuon.full_state_dict(model), **optimizer_snapshot(model, opt)}
    batches = global_batches(steps)
    for step in range(start, steps):
        rows = local_rows(batches[step], rank, world)
        loss = 0.0
        for i, chunk in enumerate(rows.tensor_split(micro)):
            skip_sync = accumulate == "no_sync" and i < micro - 1
            with dmuon.no_sync(model) if skip_sync else contextlib.nullcontext():
                micro_loss = loss_of(model, chunk) * (len(chunk) / len(rows))
                micro_loss.backward()
            loss += micro_loss.item()
        if clip is not None:
            out["norms"].append(dmuon.clip_grad_norm_(model, clip).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        out["losses"].append(loss)
        if save_at == step + 1:
            dmuon.checkpoint.save(path, model, opt,
                                  extra={"step": step + 1, "sched": sched.state_dict()})
            out["saved"] = {**dmuon.full_state_dict(model), **optimizer_snapshot(model, opt)}
    out["ledger"] = dmuon.get_ledger(model).last_step_by_phase()
    out["final"] = {**dmuon.full_state_dict(model), **optimizer_snapshot(model, opt)}
    return out


def gram_ns_flops(shape, steps: int = 5) -> int:
    """FLOPs of dmuon's default NS, counted by hand: Gram NS with one restart on m x n
    (m < n): X Xᵀ twice and Q X twice (2 m² n each), and 14 m x m products over the 5
    iterations; square matrices take the standard iteration (X Xᵀ, A·A, B·X)."""
    assert steps == 5
    m, n = sorted(shape)
    return 8 * m * m * n + 28 * m**3 if m < n else 5 * (4 * m * m * n + 2 * m**3)


def materialized_from_meta(model, layout: tuple[int, int], predicate, *, seed: int, init_fn):
    """A model built on meta, dedicated, fully sharded per layer and at the root on an
    R x N mesh, then ``dmuon.materialize``d: the meta-init tests' set-up."""
    from torch.distributed.device_mesh import init_device_mesh

    R, N = layout
    mesh = init_device_mesh("cpu", (R, N), mesh_dim_names=("replicate", "shard"))
    dmuon.dedicate_params(model, mesh["shard"], predicate=predicate,
                          replicate_mesh=mesh["replicate"] if R > 1 else None)
    fsdp_mesh = mesh if R > 1 else mesh["shard"]
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=fsdp_mesh)
    dmuon.fully_shard(model, mesh=fsdp_mesh)
    dmuon.materialize(model, seed=seed, init_fn=init_fn)
    return model
