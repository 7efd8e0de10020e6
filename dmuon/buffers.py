"""One hook boundary's packed buffer, the column values behind it and the owners'
masters: its storage. What moves them is ``boundary_transfer``'s, its gradients
``boundary_grads``'.

Layout. The boundary's Muon-target units (matrices, or slices of experts of a 3-D
param) are laid out in one flat buffer ordered by owner: shard column first, then
replica within the column. Shard column ``s`` (every rank with shard index ``s``) holds
the values of its segment, ``column_values``, in ``param_dtype``; one uneven all-gather
over the shard group fills the packed buffer on every rank of a row, and one uneven
reduce-scatter delivers each column its segment of the summed gradient. In HSDP the
column segment is ordered by replica, so a second reduce-scatter over the replicate
group hands each owner its part, and after the step one all-gather over the replicate
group refreshes the column's replicas.

The owner's master copy (``masters``) keeps the param's own dtype (fp32 under mixed
precision) and is what the optimizer updates; with no cast it is a view into
``column_values``. Module params are views into the packed buffer (3-D params keep
their own storage, filled from the buffer), so freeing resizes storage to zero, as
FSDP2 does, which keeps autograd's saved references valid once the storage is refilled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .boundary_grads import BoundaryGradients
from .boundary_transfer import BoundaryTransfer
from .cuda_graphs import check_not_capturing
from .tp import TPShard, tp_shard_of


@dataclass
class Member:
    """One unit of the partition inside a boundary: a matrix (or its TP shard), or the
    slice ``experts`` of a 3-D param."""

    fqn: str
    param: nn.Parameter
    owner: tuple[int, int]  # (replicate, shard)
    index: int  # position in the plan, for the presence of gradients
    shape: torch.Size  # of the unit as this rank's module computes with it
    offset: int = 0
    tp: TPShard | None = None
    experts: tuple[int, int] | None = None  # counted from the first expert this rank holds
    ep_base: int | None = None  # expert parallelism: the first expert this rank holds

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def module_tensor(self) -> torch.Tensor:
        """The tensor whose storage the module computes with (a TP shard's local)."""
        return self.param._local_tensor if self.tp is not None else self.param

    def grad_part(self, grad: torch.Tensor) -> torch.Tensor:
        if hasattr(grad, "to_local"):
            grad = grad.to_local()
        return grad[self.experts[0]:self.experts[1]] if self.experts else grad


def _columns_in_expert_order(members: list[Member]) -> bool:
    """Only slices of experts, each param's in expert order by (column, replica), as an
    expert-parallel plan places them: then every column's part of a param is contiguous
    in it, and the all-gather can land in the param's own storage."""
    if not members or not all(m.experts for m in members):
        return False
    ends: dict[int, int] = {}
    for m in members:  # sorted by (column, replica, plan index)
        if m.experts[0] != ends.get(id(m.param), 0):
            return False
        ends[id(m.param)] = m.experts[1]
    return True


def _segments(members: list[Member], key, count: int) -> list[int]:
    sizes = [0] * count
    for m in members:
        sizes[key(m)] += m.numel
    return sizes


class Boundary:
    """The packed buffer and gradient buffer of one hook boundary on this rank."""

    def __init__(self, name: str, members: list[Member], ctx, param_dtype, master_dtype):
        self.name, self.ctx = name, ctx
        self.param_dtype, self.master_dtype = param_dtype, master_dtype
        self.reduce_dtype = ctx.reduce_dtype or param_dtype
        for m in members:
            m.tp = tp_shard_of(m.param)
        members.sort(key=lambda m: (m.owner[1], m.owner[0], m.index))
        offset = 0
        for m in members:
            m.offset, offset = offset, offset + m.numel
        self.members, self.numel = members, offset
        self.params = list({id(m.param): m.param for m in members}.values())
        self.column_sizes = _segments(members, lambda m: m.owner[1], ctx.shard_size)
        s, r = ctx.shard_rank, ctx.replicate_rank
        self.column = [m for m in members if m.owner[1] == s]
        self.column_offset = sum(self.column_sizes[:s])
        self.replica_sizes = _segments(self.column, lambda m: m.owner[0], ctx.replicate_size)
        self.owned = [m for m in self.column if m.owner[0] == r]
        self.owned_offset = sum(self.replica_sizes[:r])
        self.direct = _columns_in_expert_order(members)
        self._allocate(ctx.device)
        self.transfer = BoundaryTransfer(self)
        self.grads = BoundaryGradients(self)

    # -- storage ---------------------------------------------------------------------
    def _allocate(self, device) -> None:
        empty = lambda n, dtype: torch.empty(n, dtype=dtype, device=device)  # noqa: E731
        self.packed = empty(0 if self.direct else self.numel, self.param_dtype)
        self.column_values = empty(self.column_sizes[self.ctx.shard_rank], self.param_dtype)
        # a 3-D param's full shape from its slices: on the meta device the param itself
        # is a storage-less placeholder of shape (0,) by now
        experts: dict[int, tuple] = {}
        for m in self.members:
            if m.experts:
                known = experts.get(id(m.param), (0,))[0]
                experts[id(m.param)] = (max(known, m.experts[1]), *m.shape[1:])
        self.expert_bases = {key: empty(shape, self.param_dtype) for key, shape in experts.items()}
        self.masters: dict[str, nn.Parameter] = {}
        for m in self.owned:
            if self.master_dtype == self.param_dtype:
                self.masters[m.fqn] = nn.Parameter(self.column_view(m))
            else:
                self.masters[m.fqn] = nn.Parameter(empty(m.shape, self.master_dtype))

    @torch.no_grad()
    def load_value(self, m: Member, value: torch.Tensor) -> None:
        """A column unit's value: into the column values, and the master if owned."""
        self.column_view(m).copy_(value)
        if m.fqn in self.masters:
            self.masters[m.fqn].copy_(value)

    def load_initial_values(self) -> None:
        """This column's values from the module's current, full tensors; called before
        ``bind_views`` replaces them."""
        for m in self.column:
            value = m.module_tensor().detach()
            self.load_value(m, value[m.experts[0]:m.experts[1]] if m.experts else value)

    @torch.no_grad()
    def set_param_dtype(self, param_dtype: torch.dtype) -> None:
        """Mixed precision adopted after ``dedicate_params``: the buffers in the new
        dtype, masters and column values carried over, the storage kept or freed as it
        was."""
        allocated = self.allocated
        values = self.column_values.to(self.master_dtype)
        masters = {fqn: t.detach().clone() for fqn, t in self.masters.items()}
        self.param_dtype = param_dtype
        self.reduce_dtype = self.ctx.reduce_dtype or param_dtype
        self._allocate(self.packed.device)
        self.column_values.copy_(values)
        for fqn, t in masters.items():
            self.masters[fqn].copy_(t)
        if not self.on_meta:
            self.bind_views()
        if not allocated:
            self.free()

    @property
    def on_meta(self) -> bool:
        """The module's tensors are still meta (until ``dmuon.materialize``)."""
        return any(m.module_tensor().is_meta for m in self.members)

    def column_view(self, m: Member) -> torch.Tensor:
        lo = m.offset - self.column_offset
        return self.column_values[lo:lo + m.numel].view(m.shape)

    def bind_views(self) -> None:
        """Point the module's tensors at the packed buffer (3-D params: their base).
        Views of a freed storage cannot be made: the caller frees afterwards."""
        self.alloc()
        for m in self.members:
            if m.experts:
                m.param.data = self.expert_bases[id(m.param)]
            else:
                m.module_tensor().data = self.packed[m.offset:m.offset + m.numel].view(m.shape)

    def check_views(self) -> None:
        """Refuse a module whose tensors no longer view the packed buffer (a plain
        ``to_empty``, or tensor parallelism applied after ``dedicate_params``): it would
        compute with values DMuon never fills. Needs the buffer allocated."""
        stray = _first_stray_view(self)
        if stray is not None:
            raise RuntimeError(
                f"'{stray}' no longer views DMuon's packed buffer: it was replaced "
                "after dmuon.dedicate_params (tensor parallelism applied after DMuon, "
                "or model.to_empty; materialise with dmuon.materialize, and apply TP "
                "first, then dedicate_params, then fully_shard)")

    def storages(self):
        return [self.packed, *self.expert_bases.values()]

    @property
    def allocated(self) -> bool:
        return self.packed.untyped_storage().nbytes() > 0

    def live_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.storages())

    def free(self) -> None:
        """Release the packed storage, once no side stream may still write it: an
        all-gather in flight (a prefetch that did not run) is waited for first."""
        self.transfer.settle()
        for t in self.storages():
            if t.untyped_storage().nbytes():
                check_not_capturing(t.device, self.name, "frees")
                t.untyped_storage().resize_(0)
        self.transfer.fresh = False

    def alloc(self) -> None:
        for t in self.storages():
            if t.untyped_storage().nbytes() == 0:
                check_not_capturing(t.device, self.name, "reallocates")
                t.untyped_storage().resize_(t.numel() * t.element_size())

    # -- owner's values out ----------------------------------------------------------
    @torch.no_grad()
    def publish(self) -> None:
        """The owners' masters, in ``param_dtype``, into the column values."""
        if self.master_dtype == self.param_dtype:
            return  # the masters are views into the column values
        for m in self.owned:
            self.column_view(m).copy_(self.masters[m.fqn])
        self.transfer.fresh = False


def _first_stray_view(b: Boundary) -> str | None:
    """The first unit whose module tensor does not view ``b``'s storage where it should."""
    elt = b.packed.element_size()
    for m in b.members:
        if m.experts:
            expected = b.expert_bases[id(m.param)].data_ptr()
        else:
            expected = b.packed.data_ptr() + m.offset * elt
        if m.module_tensor().data_ptr() != expected:
            return m.fqn
    return None


def resident_bytes(b: Boundary) -> int:
    """What ``b`` holds between steps: its column values, plus masters kept apart from
    them (mixed precision)."""
    masters = 0 if b.master_dtype == b.param_dtype else sum(
        t.numel() * t.element_size() for t in b.masters.values())
    return b.column_values.numel() * b.column_values.element_size() + masters
