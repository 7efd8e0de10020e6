"""The activation collectives of tensor parallelism, counted in DMuon's ledger (dim ``tp``).

TP's collectives are issued by DTensor, not by DMuon: a style's hooks redistribute a
module's inputs and outputs (``ColwiseParallel``'s ``Shard(1) -> Replicate`` all-gather
under sequence parallel, ``RowwiseParallel``'s ``Partial -> Replicate`` all-reduce), and
autograd converts each gradient back (the ``Partial`` gradient of a replicated input is
all-reduced). Importing dmuon wraps the public ``parallelize_module``; every module it
gives a style gets two pairs of hooks around the style's own, which read the placements
and global shapes before and after each conversion and, for the backward, the placement
each gradient actually arrives in. Every collective follows from a placement change:

- ``Partial -> Replicate``: all-reduce; ``Partial -> Shard``: reduce-scatter;
- ``Shard -> Replicate``: all-gather; ``Shard(a) -> Shard(b)``: all-to-all;
- anything else (``Replicate -> Shard``, unchanged placements): nothing is sent.

A local tensor's placement is read off its shape against the DTensor it becomes (the
same numel: replicated; fewer: sharded on the dim that differs). A ``PrepareModuleInput``
or ``PrepareModuleOutput`` with local tensors on both sides (``use_local_input`` and
``use_local_output``, as on a block of whole experts) makes and drops its DTensor inside
its hook, so none is seen there: the style's declared layouts stand in for the
placements (its hook still all-gathers the input, autograd the output's gradient).
Counted only for a model dedicated with ``dedicate_params`` (its ledger), and not while
torch.compile traces (the counts would be made once at trace time, not per step).
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_leaves

_OP = {("partial", "replicate"): "all_reduce", ("partial", "shard"): "reduce_scatter",
       ("shard", "replicate"): "all_gather"}


def _kind(placement) -> str:
    if placement.is_partial():
        return "partial"
    return "shard" if placement.is_shard() else "replicate"


def _collective(src, dst, ndim: int) -> str | None:
    """The collective that turns placement ``src`` into ``dst`` (None: none is sent)."""
    a, b = _kind(src), _kind(dst)
    if a == b == "shard" and src.dim % ndim != dst.dim % ndim:
        return "all_to_all"
    return _OP.get((a, b))


def _placement_of_local(local: torch.Tensor, dtensor):
    """The placement a local tensor had as (or becomes) ``dtensor``'s local part."""
    from torch.distributed.tensor import Replicate, Shard

    if local.numel() == dtensor.numel():
        return Replicate()
    dims = [d for d, (a, b) in enumerate(zip(local.shape, dtensor.shape)) if a != b]
    return Shard(dims[0]) if dims else Replicate()


def _record(state, src, dst, dtensor, phase: str) -> None:
    op = _collective(src, dst, dtensor.ndim)
    if op is not None:
        state.ledger.record(op, dtensor.numel() * dtensor.element_size(),
                            dtensor.device_mesh.size(), "tp", phase)


def _backward_target(placement):
    """The placement a gradient is converted to: a ``Partial`` value's gradient is
    replicated (DTensor's rule), every other one keeps the value's placement."""
    from torch.distributed.tensor import Replicate

    return Replicate() if placement.is_partial() else placement


def _count_conversion(state, before, after, declared=None) -> None:
    """One forward conversion ``before -> after`` (one of them a DTensor, or both local
    with the style's ``declared`` (layout, desired layout, mesh)), and a hook for its
    gradient's conversion back."""
    from torch.distributed.tensor import DTensor

    if declared is not None:  # the DTensor the style made of ``before`` (no collective)
        src, dst, mesh = declared
        dtensor = DTensor.from_local(before.detach(), mesh, (src,), run_check=False)
    else:
        dtensor = after if isinstance(after, DTensor) else before
        src = before.placements[0] if isinstance(before, DTensor) else \
            _placement_of_local(before, dtensor)
        dst = after.placements[0] if isinstance(after, DTensor) else \
            _placement_of_local(after, dtensor)
    _record(state, src, dst, dtensor, "recompute" if state.in_backward else "forward")
    if after.requires_grad:
        def on_grad(grad):
            g = grad.placements[0] if isinstance(grad, DTensor) else dst
            _record(state, g, _backward_target(src), dtensor, "backward")

        after.register_hook(on_grad)


def _active_state(module):
    state = getattr(module, "_dmuon_tp_state", None)
    if state is None or torch.compiler.is_compiling():
        return None
    return state()


def _count_pairs(module, before: list, after, declared: dict) -> None:
    """``declared``: ``{id(tensor in before): (layout, desired layout, mesh)}``, for the
    pairs where neither side is a DTensor."""
    from torch.distributed.tensor import DTensor

    state = _active_state(module)
    if state is None:
        return
    for b, a in zip(before, _tensors(after)):
        tp = [t for t in (b, a) if isinstance(t, DTensor) and t.device_mesh.ndim == 1]
        if b is not a and tp:
            _count_conversion(state, b, a)
        elif b is not a and id(b) in declared:
            _count_conversion(state, b, a, declared[id(b)])


def _declared_inputs(style, mesh, args, kwargs) -> dict:
    """The (layout, desired layout, mesh) a ``PrepareModuleInput`` declares for each input
    tensor, by the tensor's id (a layout without a desired one is kept, no collective)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    if isinstance(style, PrepareModuleInputOutput):
        style = style.prepare_module_input
    if not isinstance(style, PrepareModuleInput) or style.input_layouts is None:
        return {}
    triples = list(zip(args, style.input_layouts, style.desired_input_layouts or ()))
    triples += [(kwargs[k], src, style.desired_input_kwarg_layouts.get(k))
                for k, src in style.input_kwarg_layouts.items() if k in kwargs]
    return {id(t): (src, dst or src, mesh) for t, src, dst in triples
            if isinstance(t, torch.Tensor) and src is not None}


def _declared_outputs(style, mesh, output) -> dict:
    """The same for a ``PrepareModuleOutput``'s output tensors."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, PrepareModuleOutput

    if isinstance(style, PrepareModuleInputOutput):
        style = style.prepare_module_output
    if not isinstance(style, PrepareModuleOutput):
        return {}
    outputs = output if isinstance(output, tuple) else (output,)
    return {id(t): (src, dst, mesh) for t, src, dst in
            zip(outputs, style.output_layouts, style.desired_output_layouts)
            if isinstance(t, torch.Tensor) and src is not None}


def _tensors(tree) -> list:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _install_counters(module, style, mesh) -> None:
    """Hooks before and after the style's: the inputs and outputs as they were (and the
    layouts ``style`` declares for them), then as the style left them."""
    seen: dict[str, tuple] = {}

    def inputs_before(m, args, kwargs):
        counted = _active_state(m) is not None  # no look-ups while compiling or uncounted
        seen["in"] = (_tensors((args, kwargs)),
                      _declared_inputs(style, mesh, args, kwargs) if counted else {})

    def inputs_after(m, args, kwargs):
        before, declared = seen.pop("in", ([], {}))
        _count_pairs(m, before, (args, kwargs), declared)

    def outputs_before(m, _args, output):
        counted = _active_state(m) is not None
        seen["out"] = (_tensors(output),
                       _declared_outputs(style, mesh, output) if counted else {})

    def outputs_after(m, _args, output):
        before, declared = seen.pop("out", ([], {}))
        _count_pairs(m, before, output, declared)

    module.register_forward_pre_hook(inputs_before, prepend=True, with_kwargs=True)
    module.register_forward_pre_hook(inputs_after, with_kwargs=True)
    module.register_forward_hook(outputs_before, prepend=True)
    module.register_forward_hook(outputs_after)
    module._dmuon_tp_counted = True


def _counting(parallelize_module):
    @functools.wraps(parallelize_module)
    def wrapper(module, device_mesh=None, parallelize_plan=None, **kwargs):
        from torch.distributed.device_mesh import _mesh_resources
        from torch.distributed.tensor.parallel import ParallelStyle

        out = parallelize_module(module, device_mesh, parallelize_plan, **kwargs)
        if isinstance(parallelize_plan, ParallelStyle) and \
                not getattr(module, "_dmuon_tp_counted", False):
            # the mesh parallelize_module resolved (its own rule), for the declared layouts
            mesh = device_mesh or _mesh_resources.get_current_mesh()
            _install_counters(module, parallelize_plan, mesh)
        return out

    wrapper._dmuon_counts_tp = True
    return wrapper


def install_tp_traffic_counters() -> None:
    """Wrap the public ``parallelize_module`` (its recursive calls for each plan entry go
    through the module's global name, so a reference bound before ``import dmuon``
    counts too)."""
    from torch.distributed.tensor import parallel
    from torch.distributed.tensor.parallel import api

    if getattr(api.parallelize_module, "_dmuon_counts_tp", False):
        return
    api.parallelize_module = _counting(api.parallelize_module)
    parallel.parallelize_module = api.parallelize_module


def attach(model, state) -> None:
    """Count the TP modules of ``model`` in ``state``'s ledger."""
    import weakref

    ref = weakref.ref(state)
    for module in model.modules():
        if getattr(module, "_dmuon_tp_counted", False):
            module._dmuon_tp_state = ref
