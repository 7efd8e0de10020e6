"""``dmuon.Muon``: Muon on each matrix's owner alone, AdamW on FSDP2 shards for the rest."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .dedicate import get_state, is_dedicated
from .newton_schulz import check_backend, coefficient_schedule, newton_schulz
from .tp import tp_newton_schulz

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's per-matrix learning-rate scaling, on the (out, in) dims."""
    rows, cols = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def muon_update(p, grad, buf, orthogonalise, *, lr, weight_decay, momentum, nesterov,
                adjust_lr_fn, full_shape) -> None:
    """The update rule of torch.optim.Muon on one matrix (or its TP shard), in place."""
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if nesterov else buf
    ortho = orthogonalise(update)
    p.mul_(1 - lr * weight_decay)
    p.add_(ortho, alpha=-adjusted_lr(lr, adjust_lr_fn, full_shape))


class Muon(torch.optim.Optimizer):
    """Distributed Muon over a model prepared with ``dmuon.dedicate_params``.

    ``param_groups[0]`` holds the matrices this rank owns (Muon), ``param_groups[1]``
    every other parameter (``torch.optim.AdamW``, on FSDP2 shards when applied). Both
    groups carry their own ``lr``, so LR schedulers scale them together. NS defaults to
    Gram NS with one restart in ``ns_dtype`` (default: fp16 on CUDA, the gradient's
    precision on the CPU; ``ns_gram_dtype`` raises the m x m iteration's precision);
    ``ns_backend="standard"`` is torch.optim.Muon's.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_backend: str = "gram",
        ns_coefficients="quintic",
        ns_dtype: torch.dtype | None = None,
        ns_gram_dtype: torch.dtype | None = None,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        replicate_async: bool = True,
    ) -> None:
        _check_args(lr, momentum, weight_decay, ns_steps, adjust_lr_fn, adamw_lr)
        check_backend(ns_backend)
        coefficient_schedule(ns_coefficients, ns_steps)
        self._state = get_state(model)
        self.replicate_async = replicate_async
        owned = list(self._state.owned_params.values())
        self._tp_of = {id(own): m.tp for g in self._state.groups if g.is_owner
                       for m, own in zip(g.members, g.owned) if m.tp is not None}
        others = [p for p in model.parameters() if p.requires_grad and not is_dedicated(p)]
        muon_group = dict(
            params=owned, kind="muon", lr=lr, momentum=momentum, nesterov=nesterov,
            weight_decay=weight_decay, ns_steps=ns_steps, ns_backend=ns_backend,
            ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, ns_gram_dtype=ns_gram_dtype,
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        self._adamw = torch.optim.AdamW(
            others or [torch.zeros(0, requires_grad=True)], lr=adamw_lr, betas=adamw_betas,
            eps=adamw_eps, weight_decay=adamw_weight_decay,
        )
        adamw_group = dict(self._adamw.param_groups[0], params=others, kind="adamw")
        super().__init__([muon_group, adamw_group], {})
        # One source of truth: AdamW reads the group dict and state this optimizer owns.
        self._adamw.param_groups = [self.param_groups[1]]
        self._adamw.state = self.state

    @property
    def ledger(self):
        return self._state.ledger

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._state.finish_gradient_sync()
        self._muon_step(self.param_groups[0])
        if self.param_groups[1]["params"]:
            self._adamw.step()
        self._state.after_step(self.replicate_async)
        self._state.ledger.close_step()
        return loss

    def _muon_step(self, group) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            tp = self._tp_of.get(id(p))
            ns = dict(steps=group["ns_steps"], backend=group["ns_backend"],
                      coefficients=group["ns_coefficients"], dtype=group["ns_dtype"],
                      eps=group["eps"], gram_dtype=group["ns_gram_dtype"])
            if tp is None:
                orthogonalise = functools.partial(newton_schulz, **ns)
            else:  # TP peers orthogonalise the matrix together; Gram is what makes it cheap
                orthogonalise = functools.partial(tp_newton_schulz, shard=tp,
                                                  ledger=self._state.ledger, **ns)
            muon_update(
                p, p.grad, state["momentum_buffer"], orthogonalise, lr=group["lr"],
                weight_decay=group["weight_decay"], momentum=group["momentum"],
                nesterov=group["nesterov"], adjust_lr_fn=group["adjust_lr_fn"],
                full_shape=tp.full_shape if tp else p.shape,
            )


def _check_args(lr, momentum, weight_decay, ns_steps, adjust_lr_fn, adamw_lr) -> None:
    for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay),
                        ("adamw_lr", adamw_lr)):
        if not value >= 0:
            raise ValueError(f"dmuon.Muon: {name} must be >= 0, got {value}")
    if not (isinstance(ns_steps, int) and 0 < ns_steps < 100):
        raise ValueError(f"dmuon.Muon: ns_steps must be an int in [1, 99], got {ns_steps}")
    if adjust_lr_fn not in _ADJUST_LR_FNS:
        raise ValueError(
            f"dmuon.Muon: adjust_lr_fn={adjust_lr_fn!r} is not one of {list(_ADJUST_LR_FNS)}"
        )
