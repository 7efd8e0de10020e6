"""A pipeline's state under the whole model's FQNs, for ``PipelineMuon`` and
``dmuon.checkpoint``.

Each stage module keeps the model's FQNs, so this rank's share of a pipeline is the
union of its stages' shares (``dmuon.checkpoint.model_share`` / ``optimizer_share``):
the keys of a checkpoint saved on PP 2 are those of PP 1, PP 4 or an interleaved
pipeline, and DCP loads them onto whichever stage holds them now. Hyperparameters go
one group per kind (Muon's, then AdamW's), as a whole-model ``dmuon.Muon`` with its
default groups holds them, and load by kind, since the number of groups a rank holds
depends on how many stages it has.
"""

from __future__ import annotations

import torch.distributed as dist

from .checkpoint import (
    GROUP_KEYS_SKIPPED,
    global_model_keys,
    lacking,
    lacking_optim,
    model_share,
    optimizer_share,
    raise_lacking,
    republish,
)
from .checkpoint import copy_model as _copy_model
from .checkpoint import copy_tensor as _copy

KIND_ORDER = ("muon", "adamw")
_NOT_SETTINGS = (*GROUP_KEYS_SKIPPED, "kind", "use_muon")


def _saved_group(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in GROUP_KEYS_SKIPPED}


def groups_by_kind(optimizers) -> list[dict]:
    """One group per kind, Muon's first, agreed over the world (every stage's Muon is
    built with the same arguments; a rank whose stages lack a kind takes another's)."""
    mine: dict = {}
    for o in optimizers:
        for g in o.param_groups:
            mine.setdefault(g["kind"], _saved_group(g))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    agreed: dict = {}
    for kinds in everyone:
        for kind, group in kinds.items():
            agreed.setdefault(kind, group)
    return [agreed[k] for k in KIND_ORDER if k in agreed]


def load_groups_by_kind(optimizers, saved_groups: list[dict]) -> None:
    """Saved hyperparameters into every group of the same kind (the first saved group
    of that kind: a whole-model checkpoint's default groups are one per kind)."""
    for o in optimizers:
        for group in o.param_groups:
            saved = next((s for s in saved_groups if s.get("kind") == group["kind"]), None)
            if saved is not None:
                group.update({k: v for k, v in saved.items() if k not in _NOT_SETTINGS})


def optimizer_state(stages, optimizers) -> dict:
    """This rank's share of every stage's optimizer state, ``{fqn: {name: tensor}}``,
    and the groups by kind (collective: the groups are agreed over the world)."""
    state: dict = {}
    for s, o in zip(stages, optimizers):
        state.update(optimizer_share(s.submod, o)["state"])
    return {"state": state, "param_groups": groups_by_kind(optimizers)}


def share(stages, optimizers) -> tuple[dict, dict]:
    """``(model share, optimizer share)`` of this rank's stages, by the model's FQNs."""
    model_sd: dict = {}
    for s in stages:
        model_sd.update(model_share(s.submod))
    return model_sd, optimizer_state(stages, optimizers)


def _optimizer_copies(stages, optimizers, optim_sd: dict) -> list:
    """The optimizer shares' copies to make, once every key is known to be there."""
    copies, missing = [], []
    for s, o in zip(stages, optimizers):
        target = optimizer_share(s.submod, o)
        missing += lacking_optim(target, optim_sd)
        copies += [(dst, fqn, name) for fqn, tensors in target["state"].items()
                   for name, dst in tensors.items()]
    raise_lacking(missing)
    return copies


def load_optimizer_state(stages, optimizers, optim_sd: dict) -> None:
    """An ``optimizer_state``-shaped dict of the same layout into every stage's Muon."""
    for dst, fqn, name in _optimizer_copies(stages, optimizers, optim_sd):
        _copy(dst, optim_sd["state"][fqn][name], f"optim/{fqn}/{name}")
    load_groups_by_kind(optimizers, optim_sd["param_groups"])


def load_share(stages, optimizers, state_dict) -> None:
    """A ``share``-shaped ``(model_sd, optim_sd)`` into this rank's stages; every key
    is checked before anything is written."""
    model_sd, optim_sd = state_dict
    targets = [model_share(s.submod) for s in stages]
    raise_lacking([k for t in targets for k in lacking(t, model_sd)])
    copies = _optimizer_copies(stages, optimizers, optim_sd)
    for target in targets:
        _copy_model(target, model_sd)
    for dst, fqn, name in copies:
        _copy(dst, optim_sd["state"][fqn][name], f"optim/{fqn}/{name}")
    load_groups_by_kind(optimizers, optim_sd["param_groups"])
    for s in stages:
        republish(s.submod)


def model_keys(stages) -> set[str]:
    """Every stage's model keys, over the whole pipeline (collective over the world)."""
    mine = set().union(*(global_model_keys(s.submod) for s in stages))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return set().union(*everyone)
