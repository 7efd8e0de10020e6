"""One training iteration as DMuon sees it, from the root's hooks: where the forward
begins, where the backward begins and ends, and which boundaries' all-gathers go out
ahead of their compute (prefetch).

The forward's first boundaries are gathered at the root's pre-forward, overlapping the
embedding and FSDP2's own gathers; each boundary's pre-forward then gathers the next
``prefetch`` ones. In Z3 the backward re-gathers in the order the backward enters the
boundaries, starting at the root's post-forward so the last boundaries' re-gathers
overlap the loss and the head's backward. The backward ends in one end-of-backward
callback on every rank (``end_backward``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


class Iteration:
    """The root's hooks and the prefetch order of one dedicated model (``state``)."""

    def __init__(self, state):
        self.state = state
        self.in_backward = False
        self._backward_order: list = []

    # -- prefetch --------------------------------------------------------------------
    def prefetch(self, hooks, forward: bool) -> None:
        """Issue the all-gathers of the next boundaries (in backward: the ones its
        backward reaches next, Z3 only), so they overlap this boundary's compute. Every
        rank issues the same."""
        if forward == self.in_backward or not (forward or self.state.reshard_after_forward):
            return
        order = self.state.boundaries if forward else self.backward_order()
        self.gather_ahead(order, order.index(hooks.boundary), forward)

    def backward_order(self) -> list:
        """The order the backward enters the boundaries: the reverse of the order their
        forwards end (FSDP2's rule), so a boundary nested in another (experts inside
        their block) comes right after it; without nesting, the reverse forward order."""
        def ends_before(a: str, b: str) -> bool:  # a's forward ends before b's
            return b == "" or a.startswith(b + ".") if a != b else False

        boundaries = self.state.boundaries
        if len(self._backward_order) == len(boundaries):
            return self._backward_order
        done: list = []
        for b in boundaries:  # forward (pre-)order; parents come before children
            at = len(done)
            while at > 0 and ends_before(b.name, done[at - 1].name):
                at -= 1
            done.insert(at, b)
        self._backward_order = done[::-1]
        return self._backward_order

    def gather_ahead(self, order: list, i: int, forward: bool) -> None:
        """The all-gathers of the ``prefetch`` boundaries after position ``i``."""
        for k in range(1, self.state.prefetch_depth + 1):
            if 0 <= i + k < len(order):
                order[i + k].transfer.start_gather("forward" if forward else "backward")

    # -- the root's hooks ------------------------------------------------------------
    def install(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self._pre_forward)
        model.register_forward_hook(self._post_forward)

    @torch.compiler.disable  # collectives and set-up checks: eager under a compile
    def _pre_forward(self, module, args):
        self.state.before_first_forward()
        if self.in_backward:
            self.end_backward()
        self.gather_ahead(self.state.boundaries, -1, forward=True)

    def _post_forward(self, module, args, output):
        if not torch.is_grad_enabled() or self.in_backward:
            return output
        hooked = False
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_begins)
                hooked = True
        if hooked and self.state.reshard_after_forward:
            self.gather_ahead(self.backward_order(), -1, forward=False)
        return output

    def _backward_begins(self, grad):
        reduce = self.state.reduce
        if self.in_backward and reduce.backward_open:
            return grad  # another output of the same forward
        self.in_backward = True
        reduce.begin_backward()
        # Boundaries the backward did not end (inputs without grad, a param without a
        # gradient on this rank) end in one callback when the backward is over, on every
        # rank, before anything of the next step: ended at the next forward instead,
        # a rank issued DMuon's reduce after FSDP2's collectives where its peers issued
        # it before them, and NCCL wants one order across communicators (FSDP2 ends its
        # own backward the same way)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
        return grad

    def _backward_ends(self) -> None:
        if self.in_backward:
            self.end_backward()

    def end_backward(self) -> None:
        hooks = self.state.hooks
        if self.in_backward:
            for h in hooks:
                h.end_backward()
        self.in_backward = False
        self.state.reduce.end_backward()
        for h in hooks:
            h.reset()
