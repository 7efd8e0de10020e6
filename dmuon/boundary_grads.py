"""A hook boundary's gradients on this rank: summed locally in ``reduce_dtype`` as each
param's gradient lands (accumulation across backward passes, with or without
``no_sync``, sums here), handed to the ordered reduce, and the reduced mean landed in
the owners' masters' ``.grad``."""

from __future__ import annotations

import torch
from torch import nn


class BoundaryGradients:
    """The gradient buffer of one boundary (``boundary``: its storage)."""

    def __init__(self, boundary):
        self.boundary = boundary
        self.flat: torch.Tensor | None = None

    def _zeros(self) -> torch.Tensor:
        b = self.boundary
        return torch.zeros(b.numel, dtype=b.reduce_dtype, device=b.packed.device)

    @torch.no_grad()
    def accumulate(self, param: nn.Parameter) -> None:
        """Add ``param``'s gradient into the buffer and release it."""
        grad = param.grad
        if grad is None:
            return
        if self.flat is None:
            self.flat = self._zeros()
        for m in self.boundary.members:
            if m.param is param:
                part = self.flat[m.offset:m.offset + m.numel]
                part.add_(m.grad_part(grad).reshape(-1))
        param.grad = None

    def take(self) -> torch.Tensor:
        """This backward's summed local gradient (zeros where none landed)."""
        flat, self.flat = self.flat, None
        return self._zeros() if flat is None else flat

    @torch.no_grad()
    def discard(self, set_to_none: bool) -> None:
        """Forget the gradients accumulated here and on the masters (``zero_grad``)."""
        self.flat = None
        for master in self.boundary.masters.values():
            if set_to_none:
                master.grad = None
            elif master.grad is not None:
                master.grad.zero_()

    @torch.no_grad()
    def land(self, owned_flat: torch.Tensor, divisor: int) -> None:
        """Add the averaged gradient of the owned units into the masters' ``.grad``."""
        owned_flat.div_(divisor)
        lo = 0
        for m in self.boundary.owned:
            g = owned_flat[lo:lo + m.numel].view(m.shape)
            lo += m.numel
            master = self.boundary.masters[m.fqn]
            if master.grad is None:
                master.grad = g.to(master.dtype) if g.dtype != master.dtype else g
            else:
                master.grad.add_(g)
