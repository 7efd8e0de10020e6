"""Module hooks at hook boundaries: broadcast before forward, free after it (Z3),
re-broadcast before the boundary's backward (Z3), and per-param gradient hooks."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


class BoundaryHooks:
    """The hooks of one hook boundary, over all of its (boundary, owner) groups."""

    def __init__(self, name: str, module: torch.nn.Module, groups, state):
        self.name, self.module, self.groups, self.state = name, module, groups, state
        self._needs_regather = False
        self._checked = False
        self.sync_gradients = True  # False while accumulating (no_sync)
        module._dmuon_boundary = self
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)
        for group in groups:
            for m in group.members:
                m.param.register_post_accumulate_grad_hook(self._grad_hook(group))

    def unshard(self, phase: str) -> None:
        handles = []
        for g in self.groups:
            g.wait_replicate_broadcast()
            if not g.fresh:
                handles.append(g.unshard(phase))
        for h in handles:
            h.wait()
        self.state.trace(f"{phase}:{self.name}")

    def _pre_forward(self, module, args):
        if not self._checked:
            self._check_params_in_place()
        self.unshard("forward")

    def _check_params_in_place(self) -> None:
        """Refuse a model whose dedicated params were swapped out (TP applied after DMuon)."""
        for g in self.groups:
            for m in g.members:
                fqn = m.fqn.split("[")[0]  # a slice of experts names its param first
                parent, _, attr = fqn[len(self.name):].lstrip(".").rpartition(".")
                owner = self.module.get_submodule(parent) if parent else self.module
                if getattr(owner, attr) is not m.param:
                    raise RuntimeError(
                        f"'{m.fqn}' was replaced after dmuon.dedicate_params (tensor "
                        "parallelism applied after DMuon?); apply TP first, then "
                        "dedicate_params, then fully_shard"
                    )
        self._checked = True

    def _post_forward(self, module, args, output):
        if not self.state.reshard_after_forward:
            return output
        for g in self.groups:
            g.free()
        self.state.trace(f"post_forward:{self.name}")
        if not torch.is_grad_enabled():
            return output
        # A hook on every output that needs a gradient: autograd runs it before any
        # node inside the boundary, so the weights that the boundary's backward reads
        # (saved tensors viewing the freed storage) are back before they are needed.
        self._needs_regather = True
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad):
        if self._needs_regather:
            self._needs_regather = False
            self.unshard("backward")
        return grad

    def _grad_hook(self, group):
        def hook(param):
            group.grad_ready(param, self.sync_gradients, self.state.reshard_after_forward)

        return hook
