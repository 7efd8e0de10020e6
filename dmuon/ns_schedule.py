"""When and how the owned matrices are orthogonalised at the step: the landing schedule
(each boundary's params, and the NS batches it completes, while later reduces are still
on the wire), torch.optim.Muon's momentum, and NS once per batch of same-shape
matrices."""

from __future__ import annotations

import torch

from .newton_schulz import newton_schulz
from .tp import tp_newton_schulz


def momentum_update(p, buf, group) -> torch.Tensor:
    """torch.optim.Muon's momentum, in place, and the matrix it orthogonalises."""
    buf.lerp_(p.grad, 1 - group["momentum"])
    return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


def batch_key(group_index: int, p) -> tuple:
    """The NS batch a matrix joins: its group's same-shape, same-dtype matrices."""
    return (group_index, tuple(p.shape[-2:]), p.dtype)


def landing_schedule(param_groups: list[dict], boundaries: list, member_of: dict) -> dict:
    """For each boundary (by id), the Muon params it lands and the NS batches it
    completes: a batch runs once its last boundary has landed, while the reduces of
    later boundaries are still on the wire. TP shards are orthogonalised one at a time
    with their peers, so they join no batch."""
    boundary_of = {id(b.masters[m.fqn]): b for b in boundaries for m in b.owned}
    position = {id(b): i for i, b in enumerate(reversed(boundaries))}
    plan: dict[int, dict] = {id(b): {"params": [], "batches": []} for b in boundaries}
    last: dict[tuple, int] = {}
    for g, group in enumerate(param_groups):
        if group["kind"] != "muon":
            continue
        for p in group["params"]:
            b = boundary_of[id(p)]
            plan[id(b)]["params"].append((group, p))
            key = batch_key(g, p)
            if member_of[id(p)].tp is None and \
                    position[id(b)] >= position.get(last.get(key), -1):
                last[key] = id(b)
    for key, b in last.items():
        plan[b]["batches"].append(key)
    return plan


def momentum_and_tp(state: dict, p, group: tuple, tp, ledger, pending: dict,
                    updates: list) -> None:
    """Momentum (``state``: the optimizer's state of ``p``; ``group``: its index and
    options); a TP shard orthogonalises at once with its peers (one matrix at a time),
    anything else waits in its batch in ``pending``. TP peers agree on ``p.grad`` (the
    presence flags are summed over TP), so both or neither issue the Gram's all-reduce."""
    if p.grad is None:
        return
    index, options = group
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p)
    update = momentum_update(p, state["momentum_buffer"], options)
    if tp is not None:
        ortho = tp_newton_schulz(update, shard=tp, ledger=ledger, **ns_options(options))
        updates.append((p, ortho, options, tp.full_shape))
        return
    pending.setdefault(batch_key(index, p), []).append((p, update))


def ns_options(group) -> dict:
    """``newton_schulz``'s keywords from a Muon group's options."""
    return dict(steps=group["ns_steps"], backend=group["ns_backend"],
                coefficients=group["ns_coefficients"], dtype=group["ns_dtype"],
                eps=group["eps"], gram_dtype=group["ns_gram_dtype"],
                restart=group.get("ns_restart", True))


def orthogonalise_batch(group, entries: list) -> list:
    """NS once for a batch of same-shape matrices (and slices of experts): the
    updates ``(param, ortho, group, shape)``."""
    if not entries:
        return []
    shape = entries[0][0].shape[-2:]
    ortho = newton_schulz(torch.cat([u.reshape(-1, *shape) for _, u in entries]),
                          **ns_options(group))
    sizes = [u.numel() // shape.numel() for _, u in entries]
    return [(p, part.view_as(p), group, p.shape)
            for (p, _), part in zip(entries, ortho.split(sizes))]
