"""Module and autograd hooks at hook boundaries.

Forward: the boundary's all-gather (issued earlier by prefetch when possible), then the
next boundaries' all-gathers are issued so that they overlap this boundary's compute;
Z3 frees the buffer after the forward. Backward (Z3): the first gradient reaching the
boundary's outputs re-gathers it and prefetches the boundary before it. A function on
the boundary's inputs marks the end of its backward: gradients are complete, Z3 frees
the buffer again, and the reduce is handed to the ordered gradient reduce. A boundary
without such a function (its inputs need no grad) ends in the end-of-backward callback.

Activation checkpointing re-runs a boundary's forward inside the backward. Then the
buffer is gathered if needed (ledger phase ``recompute``) and never freed by the
recomputed forward: autograd is about to read it (FSDP2 has the same guard).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class _PostBackward(torch.autograd.Function):
    """Identity on the boundary's inputs whose backward runs once the boundary's own
    backward is over (FSDP2 marks its post-backward the same way)."""

    @staticmethod
    def forward(ctx, hooks, *tensors):
        ctx.hooks = hooks
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.hooks.post_backward()
        return (None, *grads)


class BoundaryHooks:
    """The hooks of one hook boundary."""

    def __init__(self, boundary, module: torch.nn.Module, state):
        self.boundary, self.module, self.state = boundary, module, state
        self.name = boundary.name
        self._checked = False
        self._pending_calls = 0  # forward calls whose backward has not finished
        self._open = False  # a forward with grad ran and its backward has not ended here
        self._regathered = False
        self._hooked: set[int] = set()
        module._dmuon_boundary = self
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        self._post_forward_handle = module.register_forward_hook(self._post_forward)
        self.hook_gradients()

    def hook_gradients(self) -> None:
        """The gradient hooks, on params off the meta device: autograd keeps them with a
        tensor's content, which ``materialize`` swaps in for a meta param (and then
        calls this again)."""
        for p in self.boundary.params:
            if not p.is_meta and id(p) not in self._hooked:
                p.register_post_accumulate_grad_hook(self._on_gradient)
                self._hooked.add(id(p))

    # -- forward -----------------------------------------------------------------------
    # Both forward hooks run eagerly under torch.compile: ``block.compile()`` compiles the
    # module's call, hooks included, and these issue collectives and resize storage. The
    # compiled region then breaks at the boundary only, as it does for FSDP2's hooks.
    @torch.compiler.disable
    def _pre_forward(self, module, args, kwargs):
        b, state = self.boundary, self.state
        recompute = state.in_backward
        if not recompute:
            self._regathered = False
        state.before_first_forward()
        b.transfer.start_gather("recompute" if recompute else "forward")
        if not recompute:
            state.iteration.prefetch(self, forward=True)
        b.transfer.wait_gather()
        if not self._checked:
            b.check_views()
            self._follow_fsdp2_post_forward()
            self._checked = True
        state.trace(f"{'recompute' if recompute else 'forward'}:{self.name}")
        if recompute and self._pending_calls:  # non-reentrant: the original graph runs
            return args, kwargs
        return self._mark_inputs(args, kwargs)

    def _follow_fsdp2_post_forward(self) -> None:
        """Re-register the post-forward hook, now that ``fully_shard`` (applied after
        ``dedicate_params``) has registered FSDP2's, so that ours runs after it. Each
        registers a pre-backward hook on the outputs, and these run in registration
        order: FSDP2's unshard of the boundary's own (small) params then goes out before
        DMuon's bulk reduce and re-gather of the neighbours. On the CPU FSDP2's
        collectives block, and behind that bulk they held up a backward whose own
        parameters had already arrived."""
        self._post_forward_handle.remove()
        self._post_forward_handle = self.module.register_forward_hook(self._post_forward)

    def _mark_inputs(self, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        self._open = self._open or torch.is_grad_enabled()
        if not idx or not torch.is_grad_enabled():
            return args, kwargs  # no function marks the end: the backward's end does
        self._pending_calls += 1
        marked = _PostBackward.apply(self, *(flat[i] for i in idx))
        for i, t in zip(idx, marked):
            flat[i] = t
        return tree_unflatten(flat, spec)

    @torch.compiler.disable
    def _post_forward(self, module, args, output):
        state, b = self.state, self.boundary
        if not state.in_backward and state.reshard_after_forward:
            b.free()
            state.trace(f"post_forward:{self.name}")
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    # -- backward ----------------------------------------------------------------------
    def _pre_backward(self, grad):
        if not self._regathered:
            self._regathered = True
            self.state.reduce.flush()
            b = self.boundary
            b.transfer.start_gather("backward")
            self.state.iteration.prefetch(self, forward=False)
            b.transfer.wait_gather()
            self.state.trace(f"backward:{self.name}")
        return grad

    def _on_gradient(self, param) -> None:
        b, state = self.boundary, self.state
        state.reduce.note_gradient(b, param)
        b.grads.accumulate(param)

    def post_backward(self) -> None:
        self._pending_calls -= 1
        if self._pending_calls <= 0:
            self._pending_calls = 0
            self._complete()

    def end_backward(self) -> None:
        """The backward is over (its end-of-backward callback): a boundary it did not end
        here ends now. A boundary whose inputs need no grad has no function to mark its
        end, so it always ends here, on every rank alike, never at a count of gradients
        that depends on this rank's data: freed in Z3, so the next forward gathers it on
        every rank alike, and handed to the reduce in the same place of every rank's
        sequence of collectives."""
        if self._open:
            self._complete()

    def _complete(self) -> None:
        self._open = False
        if self.state.reshard_after_forward:
            self.boundary.free()
            self.state.trace(f"post_backward:{self.name}")
        self.state.reduce.boundary_done(self.boundary)

    def reset(self) -> None:
        """A backward is over: nothing of it is pending, and the next backward gathers
        again (under a pipeline schedule two micro-batches' backwards may follow one
        another with no forward between them, and the first one's end freed it)."""
        self._pending_calls = 0
        self._open = False
        self._regathered = False
