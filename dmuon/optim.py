"""``dmuon.Muon``: Muon on each matrix's owner alone, AdamW on FSDP2 shards for the rest."""

from __future__ import annotations

import math

import torch
from torch import nn

from . import normuon
from . import qk_clip as qk_clip_rule
from .model_state import DedicatedModel, check_dedicated, get_state, is_dedicated
from .newton_schulz import check_backend, coefficient_schedule, newton_schulz
from .nonfinite import count_nonfinite
from .tp import tp_newton_schulz

_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_MUON_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "ns_backend",
              "ns_coefficients", "ns_dtype", "ns_gram_dtype", "eps", "adjust_lr_fn",
              "variant", "beta2", "group_name")
VARIANTS = ("muon", "normuon")
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay", "group_name")
# the reference's named groups: key -> (the Muon or AdamW option it sets, fallback keys)
_NAMED_GROUP_KEYS = {
    "muon": {"lr": ("muon_lr", "lr"), "weight_decay": ("muon_weight_decay", "weight_decay"),
             "momentum": ("momentum",)},
    "adamw": {"lr": ("adamw_lr", "lr"), "weight_decay": ("adamw_weight_decay", "weight_decay"),
              "betas": ("adamw_betas",), "eps": ("adamw_eps",)},
}
_NAMED_GROUP_EXTRA = ("params", "group_name", "name")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's per-matrix learning-rate scaling, on the (out, in) dims."""
    rows, cols = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def _momentum_update(p, buf, group) -> torch.Tensor:
    """torch.optim.Muon's momentum, in place, and the matrix it orthogonalises."""
    buf.lerp_(p.grad, 1 - group["momentum"])
    return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


def _apply(p, ortho, group, full_shape) -> None:
    """torch.optim.Muon's weight decay and step, with its per-matrix lr scaling."""
    p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(ortho, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], full_shape))


def named_groups(model: nn.Module, param_groups) -> list[dict]:
    """The reference's ``param_groups=[{"params": [...], "lr": ..., "group_name": ...}]``
    over the model's params as torch-style groups: each named group becomes a Muon group
    of its dedicated params and an AdamW group of the rest (``<name>/muon``,
    ``<name>/adamw``); ``muon_lr``/``adamw_lr``, ``muon_weight_decay``/
    ``adamw_weight_decay`` override the group's ``lr``/``weight_decay`` per kind, which
    override the constructor's. Every trainable param must be in exactly one group."""
    allowed = {k for keys in _NAMED_GROUP_KEYS.values() for ks in keys.values() for k in ks}
    out, seen = [], {}
    for i, g in enumerate(param_groups):
        extra = sorted(set(g) - allowed - set(_NAMED_GROUP_EXTRA))
        if extra:
            raise ValueError(f"dmuon.Muon: param_groups[{i}] does not take {extra}; its keys "
                             f"are {sorted(allowed | set(_NAMED_GROUP_EXTRA))}")
        if "params" not in g:
            raise ValueError(f"dmuon.Muon: param_groups[{i}] has no 'params'")
        name = g.get("group_name", g.get("name", f"group_{i}"))
        params = list(g["params"])
        for p in params:
            if id(p) in seen:
                raise ValueError(f"dmuon.Muon: a param is in param_groups {seen[id(p)]} and {i}")
            seen[id(p)] = i
        for kind, keys in _NAMED_GROUP_KEYS.items():
            chosen = [p for p in params if is_dedicated(p) == (kind == "muon")]
            options = {opt: next(g[k] for k in ks if k in g) for opt, ks in keys.items()
                       if any(k in g for k in ks)}
            if chosen:
                out.append({"params": chosen, **options, "group_name": f"{name}/{kind}"})
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(f"dmuon.Muon: param_groups leave out {missing[:4]} ({len(missing)} "
                         "trainable params); put every trainable param in a group")
    return out


def _user_groups(params, param_groups=None) -> tuple[list[dict], DedicatedModel]:
    """torch-style groups over module params (or the reference's named groups over the
    model's), and the DMuon state they belong to."""
    if param_groups is not None:
        if not isinstance(params, nn.Module):
            raise TypeError("dmuon.Muon(model, param_groups=[...]): named param groups "
                            "go with the model as the first argument")
        groups, state = named_groups(params, param_groups), get_state(params)
        return _user_groups(groups)[0], state
    if isinstance(params, nn.Module):
        trainable = [p for p in params.parameters() if p.requires_grad]
        groups = [{"params": [p for p in trainable if is_dedicated(p)]},
                  {"params": [p for p in trainable if not is_dedicated(p)]}]
        return groups, get_state(params)
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    state = None
    for g in groups:
        g["params"] = list(g["params"])
        for p in g["params"]:
            state = state or getattr(p, "_dmuon_owner_state", None)
    if state is None:
        raise ValueError("dmuon.Muon needs a model prepared with dmuon.dedicate_params, or "
                         "param groups containing at least one of its dedicated params")
    return groups, state


class Muon(torch.optim.Optimizer):
    """Distributed Muon over a model prepared with ``dmuon.dedicate_params``.

    ``params``: the model (one Muon group of the matrices this rank owns, one AdamW group
    of every other trainable param), or torch-style param groups over the model's params.
    A group holds either dedicated params (Muon; its keys override ``lr``, ``momentum``,
    ``weight_decay``, ``nesterov``, ``ns_*``, ``eps``, ``adjust_lr_fn``) or other params
    (``torch.optim.AdamW`` on FSDP2 shards; its keys ``lr``, ``betas``, ``eps``,
    ``weight_decay`` override the ``adamw_*`` defaults). Every group carries its own
    ``lr``, so LR schedulers scale them together, and says which it is: ``kind``
    (``"muon"`` or ``"adamw"``) and the reference's ``use_muon``. A step whose gradients
    are not finite on some rank (``nonfinite_ranks`` names them, ``skipped_steps``
    counts) is skipped on every rank with its gradients dropped (``skip_nonfinite=False``
    applies it).
    NS defaults to Gram NS with one restart
    in ``ns_dtype`` (default: fp16 on CUDA, the gradient's precision on the CPU;
    ``ns_gram_dtype`` raises the m x m iteration's precision); ``variant="normuon"``
    normalises each row of the orthogonalised update by its running second moment
    (``beta2``) and keeps the update's norm (``dmuon.normuon``); ``ns_backend="standard"``
    (or the reference's ``"direct"``)
    is torch.optim.Muon's. ``qk_clip=tau`` (``True``: 100) is MuonClip's QK-clip
    (``dmuon.qk_clip``): after each step the q/k rows of attention heads whose max logit
    went over tau are scaled down at their owners; ``max_logit`` and ``clipped_heads``
    record the step's largest max logit and how many heads were clipped.
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
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
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
        _check_args(muon_defaults)
        _check_adamw_args(adamw_defaults)
        user_groups, self._state = _user_groups(params, param_groups)
        check_dedicated(self._state)
        self.replicate_async, self.skip_nonfinite = replicate_async, skip_nonfinite
        # steps skipped for a non-finite gradient; the last step's ranks (or ["fsdp2"])
        self.skipped_steps, self.nonfinite_ranks = 0, []
        self._member_of = _members_by_master(self._state)
        super().__init__(self._groups(user_groups, muon_defaults, adamw_defaults), {})
        # One source of truth: AdamW reads the group dicts and state this optimizer owns.
        self._adamw.param_groups = [g for g in self.param_groups if g["kind"] == "adamw"]
        self._adamw.state = self.state
        self._state.attach_optimizer()
        self._attach_qk_clip(qk_clip)

    def _groups(self, user_groups, muon_defaults: dict, adamw_defaults: dict) -> list[dict]:
        """Muon groups of this rank's masters, then AdamW groups as torch.optim.AdamW
        completes them (``self._adamw`` steps them)."""
        muon, adamw = [], []
        for i, g in enumerate(user_groups):
            options = {k: v for k, v in g.items() if k != "params"}
            if _group_kind(i, g["params"]) == "muon":
                muon.append(self._muon_group(g["params"], {**muon_defaults, **options}, i))
            else:
                adamw.append({**adamw_defaults, **_only(options, _ADAMW_KEYS, i, "AdamW"),
                              "params": g["params"]})
        self._adamw = torch.optim.AdamW(
            adamw or [{"params": [torch.zeros(0, requires_grad=True)]}], **adamw_defaults)
        return muon + [dict(g, kind="adamw", use_muon=False)
                       for g in self._adamw.param_groups[:len(adamw)]]

    def _muon_group(self, module_params, options: dict, index: int) -> dict:
        options = _only(options, _MUON_KEYS, index, "Muon")
        _check_args(options)
        wanted = {p._dmuon_dedicated for p in module_params}
        masters = [t for fqn, t in self._state.owned_params.items()
                   if self._state.plan.params[fqn].param in wanted]
        return {**options, "params": masters, "kind": "muon", "use_muon": True}

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

    def _schedule(self) -> dict[int, list]:
        """For each boundary, the Muon params it lands and the NS batches it completes:
        a batch (a group's same-shape matrices) runs once its last boundary has landed,
        while the reduces of later boundaries are still on the wire."""
        boundary_of = {id(b.masters[m.fqn]): b for b in self._state.boundaries for m in b.owned}
        position = {id(b): i for i, b in enumerate(reversed(self._state.boundaries))}
        plan: dict[int, dict] = {id(b): {"params": [], "batches": []}
                                 for b in self._state.boundaries}
        last: dict[tuple, int] = {}
        for g, group in enumerate(self.param_groups):
            if group["kind"] != "muon":
                continue
            for p in group["params"]:
                b = boundary_of[id(p)]
                plan[id(b)]["params"].append((group, p))
                key = (g, tuple(p.shape[-2:]), p.dtype)
                if self._member_of[id(p)].tp is None and \
                        position[id(b)] >= position.get(last.get(key), -1):
                    last[key] = id(b)
        for key, b in last.items():
            plan[b]["batches"].append(key)
        return plan

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates, skip = self._orthogonalised_updates()
        if not skip:
            skip = self._check_updates(updates)
        if skip:
            self.skipped_steps += 1
            self.zero_grad(set_to_none=True)  # on every rank alike: no update, no state
        else:
            for p, ortho, group, full_shape in updates:
                _apply(p, self._variant_update(p, ortho, group), group, full_shape)
            if any(g["params"] for g in self._adamw.param_groups):
                self._adamw.step()
        if self._qk_clip is not None:
            self._clip_qk(skip)
        self._state.after_step(self.replicate_async)
        self._state.ledger.close_step()
        return loss

    def _attach_qk_clip(self, tau) -> None:
        """QK-clip over the dedicated model's attention modules (tau None: off), and its
        record of the last step."""
        self._qk_clip, self.max_logit, self.clipped_heads = None, None, 0
        if tau is None or tau is False:
            return
        model = self._state.model()
        if model is None:
            raise ValueError("dmuon.Muon(qk_clip=...) needs the dedicated model")
        masters = {id(self._member_of[id(t)].param): t
                   for t in self._state.owned_params.values()}
        self._qk_clip = qk_clip_rule.QKClip(model, tau, masters)

    def _clip_qk(self, skip: bool) -> None:
        """After the update, before the post-step broadcast carries the rows: the max
        logits reduced over the data-parallel groups (under TP each rank holds its own
        heads), the owned q/k rows of heads over tau scaled."""
        self._qk_clip.clip(self._state.data_parallel_groups(), self.ledger, skip,
                           tp_group=self._state.ctx.tp_group)
        self.max_logit, self.clipped_heads = self._qk_clip.max_logit, \
            self._qk_clip.clipped_heads

    def _orthogonalised_updates(self) -> tuple[list, bool]:
        """Every owned matrix's orthogonalised update, computed as its gradient lands;
        or, when some rank's gradients were not finite, none (True: skip the step)."""
        schedule, pending, updates, skip = self._schedule(), {}, [], False
        self.nonfinite_ranks = []
        for i, b in enumerate(self._state.landing_order()):
            if i == 0:  # the first landing waited for the flags every rank shares
                self.nonfinite_ranks = self._state.nonfinite_ranks()
                skip = self.skip_nonfinite and bool(self.nonfinite_ranks)
            if skip:
                continue
            for group, p in schedule[id(b)]["params"]:
                self._momentum_and_tp(group, p, pending, updates)
            for key in schedule[id(b)]["batches"]:
                updates += self._orthogonalise(self.param_groups[key[0]], pending.pop(key, []))
        return updates, skip

    def _check_updates(self, updates: list) -> bool:
        """Whether an orthogonalised update is not finite on some rank (NS overflowing
        in half precision, say): agreed on every rank, TP peers included, before any
        param moves, so every rank skips the same steps. Momentum keeps the (finite)
        gradient it absorbed."""
        local = count_nonfinite(ortho for _, ortho, _, _ in updates)
        if local is None:
            local = torch.zeros((), device=self._state.ctx.device)
        if not self._state.agree(local):
            return False
        if not self.nonfinite_ranks:
            self.nonfinite_ranks = ["update"]
        return self.skip_nonfinite

    def _variant_update(self, p, ortho, group) -> torch.Tensor:
        """The update the group's variant makes of NS's output (after the steps' skip
        is agreed, so a skipped step leaves NorMuon's statistics as they were)."""
        if group["variant"] != "normuon":
            return ortho
        state = self.state[p]
        if normuon.ROW_STATE not in state:
            state[normuon.ROW_STATE] = normuon.second_moment_like(p)
        return normuon.normalise_rows(ortho, state[normuon.ROW_STATE], group["beta2"],
                                      tp=self._member_of[id(p)].tp, ledger=self.ledger)

    @staticmethod
    def _ns_options(group) -> dict:
        return dict(steps=group["ns_steps"], backend=group["ns_backend"],
                    coefficients=group["ns_coefficients"], dtype=group["ns_dtype"],
                    eps=group["eps"], gram_dtype=group["ns_gram_dtype"])

    def _momentum_and_tp(self, group, p, pending: dict, updates: list) -> None:
        """Momentum; a TP shard orthogonalises at once with its peers (one matrix at a
        time), anything else waits in its batch. TP peers agree on ``p.grad`` (the
        presence flags are summed over TP), so both or neither issue the Gram's
        all-reduce."""
        if p.grad is None:
            return
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        update = _momentum_update(p, state["momentum_buffer"], group)
        tp = self._member_of[id(p)].tp
        if tp is not None:
            ortho = tp_newton_schulz(update, shard=tp, ledger=self._state.ledger,
                                     **self._ns_options(group))
            updates.append((p, ortho, group, tp.full_shape))
            return
        g = next(i for i, x in enumerate(self.param_groups) if x is group)
        pending.setdefault((g, tuple(p.shape[-2:]), p.dtype), []).append((p, update))

    def _orthogonalise(self, group, entries: list) -> list:
        """NS once for a batch of same-shape matrices (and slices of experts): the
        updates ``(param, ortho, group, shape)``."""
        if not entries:
            return []
        shape = entries[0][0].shape[-2:]
        ortho = newton_schulz(torch.cat([u.reshape(-1, *shape) for _, u in entries]),
                              **self._ns_options(group))
        sizes = [u.numel() // shape.numel() for _, u in entries]
        return [(p, part.view_as(p), group, p.shape)
                for (p, _), part in zip(entries, ortho.split(sizes))]


def _members_by_master(state: DedicatedModel) -> dict:
    """``id(master)`` -> its partition member, for the matrices this rank owns."""
    members = {m.fqn: m for b in state.boundaries for m in b.owned}
    return {id(t): members[fqn] for fqn, t in state.owned_params.items()}


def _group_kind(index: int, params) -> str:
    kinds = {is_dedicated(p) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"dmuon.Muon: param group {index} mixes dedicated (Muon) params "
                         "with others (AdamW); put them in separate groups")
    return "muon" if kinds == {True} else "adamw"


def _only(options: dict, allowed, index: int, kind: str) -> dict:
    extra = sorted(set(options) - set(allowed))
    if extra:
        raise ValueError(f"dmuon.Muon: param group {index} ({kind}) does not take {extra}; "
                         f"its options are {list(allowed)}")
    return options


def _check_adamw_args(o: dict) -> None:
    for name in ("lr", "weight_decay"):
        if not o[name] >= 0:
            raise ValueError(f"dmuon.Muon: adamw_{name} must be >= 0, got {o[name]}")


def _check_args(o: dict) -> None:
    for name in ("lr", "momentum", "weight_decay"):
        if not o[name] >= 0:
            raise ValueError(f"dmuon.Muon: {name} must be >= 0, got {o[name]}")
    if not (isinstance(o["ns_steps"], int) and 0 < o["ns_steps"] < 100):
        raise ValueError(f"dmuon.Muon: ns_steps must be an int in [1, 99], got {o['ns_steps']}")
    if o["variant"] not in VARIANTS:
        raise ValueError(f"dmuon.Muon: variant={o['variant']!r} is not one of {list(VARIANTS)}")
    if not 0 <= o["beta2"] < 1:
        raise ValueError(f"dmuon.Muon: beta2 must be in [0, 1), got {o['beta2']}")
    if o["adjust_lr_fn"] not in _ADJUST_LR_FNS:
        raise ValueError(
            f"dmuon.Muon: adjust_lr_fn={o['adjust_lr_fn']!r} is not one of {list(_ADJUST_LR_FNS)}"
        )
    o["ns_backend"] = check_backend(o["ns_backend"])
    coefficient_schedule(o["ns_coefficients"], o["ns_steps"])
