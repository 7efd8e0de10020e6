"""Expert parallelism (EP): each EP rank holds E/P experts of every MoE layer, and inside
one EP coordinate the ranks that share those experts (the expert shard group) own them
DMuon's way.

The EP group is ``ep_size`` consecutive ranks of the shard group (shard index ``s = j *
P + e``: EP coordinate ``e``, expert shard index ``j``), as torchtitan borrows its EP
ranks from the innermost data-parallel shard dim, so that the token all-to-all stays
among neighbours (one node's NVLink). The expert shard group is every P-th rank of the
shard group: the ranks of one EP coordinate, ``N / P`` of them.

``shard_experts`` cuts each expert-parallel 3-D param to this rank's experts before
``dedicate_params`` (on the meta device nothing is allocated) and marks it with the
layer's expert count, so the plan, ``materialize`` and the state dicts see the whole
layer; ``dedicate_params`` then owns the slices inside the expert shard group, gathers
them over it alone and reduces their gradients over it (and ``replicate``), divided by
the whole data-parallel world: every rank's tokens reach the expert through the
all-to-all (``dmuon.expert_dispatch``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .partition import EP_ATTR, check_ep
from .process_groups import Communicators, mesh_device


def _rows(group) -> list[tuple[int, ...]]:
    """Every shard group's members (in group-rank order), the same list on every rank."""
    mine = tuple(dist.get_process_group_ranks(group))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    return sorted(set(rows))


def ep_subgroups(shard_group, ep_size: int, expert_shard: bool, comms):
    """This rank's EP group (``expert_shard=False``) or expert shard group, made for
    every shard group in one order (``new_group`` is collective over the world) through
    ``comms`` (``process_groups.Communicators``), which warms them at set-up."""
    me, found = dist.get_rank(), None
    for row in _rows(shard_group):
        if expert_shard:
            parts = [row[e::ep_size] for e in range(ep_size)]
        else:
            parts = [row[j:j + ep_size] for j in range(0, len(row), ep_size)]
        for part in parts:
            group = comms.new_group(part, "expert_shard" if expert_shard else "ep")
            if me in part:
                found = group
    return found


def _local_experts(p: nn.Parameter, ep_size: int, ep: int) -> nn.Parameter:
    experts = p.shape[0]
    per = experts // ep_size
    local = p.detach()[ep * per:(ep + 1) * per]
    local = local if p.is_meta else local.clone()
    out = nn.Parameter(local, requires_grad=p.requires_grad)
    setattr(out, EP_ATTR, (experts, ep_size, ep))
    return out


def shard_experts(model: nn.Module, predicate, shard_mesh, ep_size: int):
    """Cut every 3-D param ``predicate`` selects to this rank's E/P experts (collective:
    every rank of the world calls it) and return this rank's EP group, which the MoE
    layers dispatch their tokens over. ``shard_mesh``: the 1-D shard mesh that
    ``dedicate_params`` is given; ``ep_size`` must divide it (1: nothing is cut, and the
    group is this rank alone)."""
    experts = {name: p for name, p in model.named_parameters()
               if p.ndim == 3 and predicate(name, p)} if ep_size != 1 else {}
    check_ep({n: p.shape for n, p in experts.items()}, experts, shard_mesh.size(), ep_size)
    ep = shard_mesh.get_local_rank() % ep_size
    for name, p in experts.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, _local_experts(p, ep_size, ep))
    comms = Communicators()  # the dispatch's all-to-all group, warmed here
    group = ep_subgroups(shard_mesh.get_group(), ep_size, False, comms)
    comms.warm(mesh_device(shard_mesh))
    return group


def gather_experts(local: torch.Tensor, ep_group) -> torch.Tensor:
    """The whole layer's experts from each EP rank's E/P (collective over the EP group)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(ep_group))]
    dist.all_gather(parts, local.contiguous(), group=ep_group)
    return torch.cat(parts)
