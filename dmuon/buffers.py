"""The packed buffer of one (hook boundary, owner) group and its lifecycle.

The module's parameters of a group are views into one flat buffer, so one broadcast
fills them all. Freeing resizes the storage to zero (as FSDP2 does), which keeps the
views, and autograd's saved references to them, valid once the storage is refilled.
The owner's authoritative copy lives apart from the buffer (``owned``), so the buffer
holds the same thing on every rank and Z2/Z3 differ only in when it is freed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import comm
from .tp import TPShard, tp_shard_of


@dataclass
class Member:
    fqn: str
    param: nn.Parameter  # the module's parameter
    local: torch.Tensor  # its storage (the local shard of a TP DTensor): a packed view
    offset: int
    numel: int
    tp: TPShard | None
    experts: tuple[int, int] | None = None  # this unit is param[lo:hi] of a 3-D param

    @property
    def shape(self) -> torch.Size:
        if self.experts is not None:
            lo, hi = self.experts
            return torch.Size((hi - lo, *self.param.shape[1:]))
        return self.local.shape

    def local_grad(self) -> torch.Tensor | None:
        g = self.param.grad
        if g is not None and hasattr(g, "to_local"):
            g = g.to_local()
        if g is not None and self.experts is not None:
            g = g[self.experts[0]:self.experts[1]]
        return g


@dataclass
class RankContext:
    """Where this rank sits: its shard and replicate groups and the shared ledger."""

    shard_group: object
    shard_rank: int
    shard_size: int
    replicate_group: object
    replicate_rank: int
    replicate_size: int
    ledger: comm.Ledger


class PackedGroup:
    """Params of one hook boundary that share an owner.

    A slice of experts of a 3-D param is a group of its own (``expert_base``): its packed
    buffer is that slice of the param's storage, which the slices' groups share, so
    the param stays one tensor while each slice comes from its own owner.
    """

    def __init__(self, boundary: str, owner_coord: tuple[int, int], params, ctx: RankContext,
                 experts: tuple[int, int] | None = None, expert_base=None):
        self.boundary = boundary
        self.owner_replicate, self.owner_shard = owner_coord
        self.ctx = ctx
        self.members: list[Member] = []
        offset = 0
        for fqn, p in params:
            local = p._local_tensor if hasattr(p, "_local_tensor") else p
            m = Member(fqn, p, local, offset, 0, tp_shard_of(p), experts)
            m.numel = m.shape.numel()
            self.members.append(m)
            offset += m.numel
        self.numel = offset
        self.dtype, self.device = params[0][1].dtype, params[0][1].device
        # Column owners (every rank of the owner's shard column) keep the full value;
        # in 1-D there is one column owner, the owner itself.
        self.is_column_owner = ctx.shard_rank == self.owner_shard
        self.is_owner = self.is_column_owner and ctx.replicate_rank == self.owner_replicate
        self.owned: list[nn.Parameter] = []
        if self.is_column_owner:
            self.owned = [nn.Parameter(self._initial_value(m)) for m in self.members]
        self.storage = expert_base if expert_base is not None else torch.empty(
            self.numel, dtype=self.dtype, device=self.device)
        self._storage_nbytes = self.storage.numel() * self.storage.element_size()
        if expert_base is None:
            self.packed = self.storage
            for m in self.members:
                m.local.data = self.packed[m.offset:m.offset + m.numel].view(m.shape)
        else:
            per_expert = self.numel // (experts[1] - experts[0])
            self._alloc()  # a sibling slice's group may have freed it already
            self.packed = expert_base.view(-1)[experts[0] * per_expert:experts[1] * per_expert]
        self.free()
        self.fresh = False  # packed buffer holds the owner's current values
        self._ready: set[int] = set()
        self._grad_flat: torch.Tensor | None = None
        self._reduce_handle = None
        self.replicate_handle = None

    @staticmethod
    def _initial_value(m: Member) -> torch.Tensor:
        value = m.local.detach()
        if m.experts is not None:
            value = value[m.experts[0]:m.experts[1]]
        return value.clone()

    # -- storage -----------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.storage.untyped_storage().nbytes() > 0

    def free(self) -> None:
        self.storage.untyped_storage().resize_(0)
        self.fresh = False

    def _alloc(self) -> None:
        if not self.allocated:
            self.storage.untyped_storage().resize_(self._storage_nbytes)

    # -- parameter broadcast ---------------------------------------------------------
    @torch.no_grad()
    def unshard(self, phase: str):
        """Fill the packed buffer from the owner; returns the broadcast's handle."""
        self._alloc()
        ctx = self.ctx
        # In-place writes into storage autograd saved must not trip its version check:
        # the values written are the ones that were saved.
        with torch.autograd._unsafe_preserve_version_counter(self.packed):
            if self.is_column_owner:
                for m, own in zip(self.members, self.owned):
                    self.packed[m.offset:m.offset + m.numel].copy_(own.view(-1))
            handle = comm.broadcast(
                self.packed, self.owner_shard, ctx.shard_group, ctx.ledger, "shard", phase
            )
        self.fresh = True
        return handle

    # -- gradient reduce -------------------------------------------------------------
    def grad_ready(self, param: nn.Parameter, sync: bool, reshard: bool) -> None:
        """Called as each member's gradient lands; the last one starts the reduce."""
        self._ready.add(id(param))
        if len(self._ready) < len(self.members):
            return
        self._ready.clear()
        if sync:
            self.start_reduce()
        if reshard:
            self.free()

    @torch.no_grad()
    def start_reduce(self) -> None:
        flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for m in self.members:
            grad = m.local_grad()
            if grad is not None:
                flat[m.offset:m.offset + m.numel].copy_(grad.reshape(-1))
                if m.experts is None:  # sibling slices still read a 3-D param's grad
                    m.param.grad = None
        self._grad_flat = flat
        ctx = self.ctx
        self._reduce_handle = comm.reduce_sum(
            flat, self.owner_shard, ctx.shard_group, ctx.ledger, "shard", "reduce"
        )

    @property
    def reduce_pending(self) -> bool:
        return self._reduce_handle is not None

    def has_local_grads(self) -> bool:
        return any(m.param.grad is not None for m in self.members)

    @torch.no_grad()
    def finish_reduce(self) -> None:
        """Wait for the reduce; the owner takes the averaged gradient, others drop it."""
        if self._reduce_handle is None:
            return
        self._reduce_handle.wait()
        flat, ctx = self._grad_flat, self.ctx
        self._reduce_handle = self._grad_flat = None
        if ctx.replicate_size > 1 and self.is_column_owner:
            comm.reduce_sum(
                flat, self.owner_replicate, ctx.replicate_group, ctx.ledger,
                "replicate", "reduce",
            ).wait()
        if not self.is_owner:
            return
        flat.div_(ctx.shard_size * ctx.replicate_size)
        for m, own in zip(self.members, self.owned):
            g = flat[m.offset:m.offset + m.numel].view(own.shape)
            own.grad = g if own.grad is None else own.grad.add_(g)

    # -- HSDP post-step fan-out ------------------------------------------------------
    def start_replicate_broadcast(self) -> None:
        if self.ctx.replicate_size == 1 or not self.is_column_owner:
            return
        flat = torch.cat([own.detach().view(-1) for own in self.owned])
        handle = comm.broadcast(
            flat, self.owner_replicate, self.ctx.replicate_group, self.ctx.ledger,
            "replicate", "replicate",
        )
        self.replicate_handle = (handle, flat)

    @torch.no_grad()
    def wait_replicate_broadcast(self) -> None:
        if self.replicate_handle is None:
            return
        handle, flat = self.replicate_handle
        self.replicate_handle = None
        handle.wait()
        if not self.is_owner:
            for m, own in zip(self.members, self.owned):
                own.copy_(flat[m.offset:m.offset + m.numel].view(own.shape))
