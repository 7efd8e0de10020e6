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

    def local_grad(self) -> torch.Tensor | None:
        g = self.param.grad
        return g.to_local() if g is not None and hasattr(g, "to_local") else g


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
    """Params of one hook boundary that share an owner."""

    def __init__(self, boundary: str, owner_coord: tuple[int, int], params, ctx: RankContext):
        self.boundary = boundary
        self.owner_replicate, self.owner_shard = owner_coord
        self.ctx = ctx
        self.members: list[Member] = []
        offset = 0
        for fqn, p in params:
            local = p._local_tensor if hasattr(p, "_local_tensor") else p
            self.members.append(Member(fqn, p, local, offset, local.numel(), tp_shard_of(p)))
            offset += local.numel()
        first = self.members[0].local
        self.numel = offset
        self.dtype, self.device = first.dtype, first.device
        # Column owners (every rank of the owner's shard column) keep the full value;
        # in 1-D there is one column owner, the owner itself.
        self.is_column_owner = ctx.shard_rank == self.owner_shard
        self.is_owner = self.is_column_owner and ctx.replicate_rank == self.owner_replicate
        self.owned: list[nn.Parameter] = []
        if self.is_column_owner:
            self.owned = [nn.Parameter(m.local.detach().clone()) for m in self.members]
        self.packed = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for m in self.members:
            m.local.data = self.packed[m.offset:m.offset + m.numel].view(m.local.shape)
        self.free()
        self.fresh = False  # packed buffer holds the owner's current values
        self._ready: set[int] = set()
        self._grad_flat: torch.Tensor | None = None
        self._reduce_handle = None
        self.replicate_handle = None

    # -- storage -----------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.numel * self.packed.element_size()

    @property
    def allocated(self) -> bool:
        return self.packed.untyped_storage().nbytes() > 0

    def free(self) -> None:
        self.packed.untyped_storage().resize_(0)
        self.fresh = False

    def _alloc(self) -> None:
        if not self.allocated:
            self.packed.untyped_storage().resize_(self.nbytes)

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
