"""``dmuon.Muon``: Muon on each matrix's owner alone, AdamW on FSDP2 shards for the rest."""

from __future__ import annotations

import math

import torch

from . import normuon
from . import qk_clip as qk_clip_rule
from .model_state import DedicatedModel, check_dedicated
from .nonfinite import count_nonfinite
from .ns_schedule import (
    landing_schedule,
    momentum_and_tp,
    orthogonalise_batch,
)
from .param_groups import check_adamw_args, check_args, split_groups, user_groups
from .reference_clip import ReferenceClipMethods


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's per-matrix learning-rate scaling, on the (out, in) dims."""
    rows, cols = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def _apply_updates(updates: list, state: dict, member_of: dict, ledger) -> None:
    """NorMuon's normalisation where the group asks for it (plain Muon steps with NS's
    output), then torch.optim.Muon's weight decay and step with its per-matrix lr
    scaling."""
    for p, ortho, group, full_shape in updates:
        if group["variant"] == "normuon":
            ortho = normuon.normuon_update(state[p], p, ortho, group, member_of[id(p)].tp,
                                           ledger)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(ortho, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], full_shape))


class Muon(ReferenceClipMethods, torch.optim.Optimizer):
    """Distributed Muon over a model prepared with ``dmuon.dedicate_params``: Muon at
    each matrix's owner, ``torch.optim.AdamW`` on FSDP2 shards for every other param.

    ``params``: the model, torch-style param groups over its params, or (with
    ``param_groups``) the reference's named groups (``dmuon.param_groups``). Every group
    carries its own ``lr`` and says which it is (``kind``, the reference's ``use_muon``).
    A step whose gradients or updates are not finite on some rank is skipped on every
    rank (``nonfinite_ranks``, ``skipped_steps``; ``skip_nonfinite=False`` applies it).
    ``variant="normuon"`` is NorMuon (``dmuon.normuon``), ``qk_clip=tau`` MuonClip's
    QK-clip (``dmuon.qk_clip``; ``max_logit`` and ``clipped_heads`` record the step).
    Every option: docs/core.md, "Update rule and param groups".
    """

    def __init__(
        self,
        params,
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
        variant: str = "muon",
        beta2: float = normuon.BETA2,
        adamw_lr: float = 1e-3, adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8, adamw_weight_decay: float = 0.0,
        replicate_async: bool = True,
        param_groups: list[dict] | None = None,
        skip_nonfinite: bool = True, qk_clip: float | bool | None = None,
    ) -> None:
        muon_defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov,
                             weight_decay=weight_decay, ns_steps=ns_steps,
                             ns_backend=ns_backend, ns_coefficients=ns_coefficients,
                             ns_dtype=ns_dtype, ns_gram_dtype=ns_gram_dtype, eps=eps,
                             adjust_lr_fn=adjust_lr_fn, variant=variant, beta2=beta2)
        adamw_defaults = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                              weight_decay=adamw_weight_decay)
        check_args(muon_defaults), check_adamw_args(adamw_defaults)
        groups, self._state = user_groups(params, param_groups)
        check_dedicated(self._state)
        self.replicate_async, self.skip_nonfinite = replicate_async, skip_nonfinite
        # steps skipped for a non-finite gradient; the last step's ranks (or ["fsdp2"])
        self.skipped_steps, self.nonfinite_ranks = 0, []
        self._member_of = _members_by_master(self._state)
        super().__init__(self._groups(groups, muon_defaults, adamw_defaults), {})
        # One source of truth: AdamW reads the group dicts and state this optimizer owns.
        self._adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
        self._adamw.state = self.state
        self._state.attach_optimizer()
        self._qk_clip = qk_clip_rule.for_optimizer(self._state, qk_clip, self._member_of)
        self.max_logit, self.clipped_heads = None, 0  # QK-clip's record of the last step

    def _groups(self, user_groups, muon_defaults: dict, adamw_defaults: dict) -> list[dict]:
        """Muon groups of this rank's masters, then AdamW groups as torch.optim.AdamW
        completes them (``self._adamw`` steps them)."""
        muon, adamw = split_groups(user_groups, muon_defaults, adamw_defaults, self._state)
        self._adamw = torch.optim.AdamW(
            adamw or [{"params": [torch.zeros(0, requires_grad=True)]}], **adamw_defaults)
        return muon + [dict(g, kind="adamw", use_muon=False)
                       for g in self._adamw.param_groups[:len(adamw)]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, and every gradient DMuon holds for the
        step (local, on the wire or landed) dropped with it (and QK-clip's max logits)."""
        self._state.discard_gradients(set_to_none)
        if self._qk_clip is not None:
            self._qk_clip.discard()
        super().zero_grad(set_to_none)

    @property
    def ledger(self):
        return self._state.ledger

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.finish_step(*self.orthogonalised_updates())
        return loss

    def finish_step(self, updates: list, skip: bool, agree=None) -> None:
        """Apply ``orthogonalised_updates``' result, or skip the step; ``agree(flag)``
        says whether a non-finite update was seen anywhere (this model's layout; a
        pipeline passes its own, over every stage)."""
        if not skip:
            skip = self._check_updates(updates, agree or self._state.agree)
        if skip:
            self.skipped_steps += 1
            self.zero_grad(set_to_none=True)  # on every rank alike: no update, no state
        else:
            _apply_updates(updates, self.state, self._member_of, self.ledger)
            if any(g["params"] for g in self._adamw.param_groups):
                self._adamw.step()
        if self._qk_clip is not None:
            self._clip_qk(skip)
        self._state.after_step(self.replicate_async)
        self._state.ledger.close_step()

    def _clip_qk(self, skip: bool) -> None:
        """After the update, before the post-step broadcast carries the rows: the max
        logits reduced over the data-parallel groups (under TP each rank holds its own
        heads), the owned q/k rows of heads over tau scaled."""
        self._qk_clip.clip(self._state.data_parallel_groups(), self.ledger, skip,
                           tp_group=self._state.ctx.tp_group)
        self.max_logit, self.clipped_heads = self._qk_clip.max_logit, \
            self._qk_clip.clipped_heads

    def orthogonalised_updates(self) -> tuple[list, bool]:
        """Every owned matrix's orthogonalised update, computed as its gradient lands;
        or, when some rank's gradients were not finite, none (True: skip the step)."""
        schedule = landing_schedule(self.param_groups, self._state.boundaries, self._member_of)
        pending, updates, skip = {}, [], False
        self.nonfinite_ranks = []
        for i, b in enumerate(self._state.landing_order()):
            if i == 0:  # the first landing waited for the flags every rank shares
                self.nonfinite_ranks = self._state.nonfinite_ranks()
                skip = self.skip_nonfinite and bool(self.nonfinite_ranks)
            if skip:
                continue
            for group, p in schedule[id(b)]["params"]:
                g = next(j for j, x in enumerate(self.param_groups) if x is group)
                momentum_and_tp(self.state[p], p, (g, group), self._member_of[id(p)].tp,
                                self.ledger, pending, updates)
            for key in schedule[id(b)]["batches"]:
                updates += orthogonalise_batch(self.param_groups[key[0]], pending.pop(key, []))
        if not self._state.boundaries:  # no matrix (a pipeline stage): no landing waited
            self.nonfinite_ranks = self._state.nonfinite_ranks()
            skip = self.skip_nonfinite and bool(self.nonfinite_ranks)
        return updates, skip

    def _check_updates(self, updates: list, agree) -> bool:
        """Whether an orthogonalised update is not finite on some rank (NS overflowing
        in half precision, say): agreed on every rank, TP peers included, before any
        param moves, so every rank skips the same steps. Momentum keeps the (finite)
        gradient it absorbed."""
        local = count_nonfinite(ortho for _, ortho, _, _ in updates)
        if not agree(torch.zeros((), device=self._state.ctx.device) if local is None
                     else local):
            return False
        if not self.nonfinite_ranks:
            self.nonfinite_ranks = ["update"]
        return self.skip_nonfinite


def _members_by_master(state: DedicatedModel) -> dict:
    """``id(master)`` -> its partition member, for the matrices this rank owns."""
    members = {m.fqn: m for b in state.boundaries for m in b.owned}
    return {id(t): members[fqn] for fqn, t in state.owned_params.items()}
