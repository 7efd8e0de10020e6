"""CUDA graphs and Z3 do not mix: refuse them by name.

A CUDA graph replays the device addresses it captured. Z3 releases each packed buffer's
storage after the forward and allocates it again before the backward and the next
forward (``Boundary.free``), so a block compiled with CUDA graphs (``torch.compile``
modes ``reduce-overhead`` and ``max-autotune``, or inductor's ``triton.cudagraphs``)
would read parameters from addresses that no longer hold them, or re-record every
step. Z2 keeps the packed storage for the whole run (its addresses are stable).

Two checks: at the first forward, every compile wrapper that can reach a boundary (on
it, inside it, around it in the model, around the whole model on the call stack); and
at every Z3 gather and free, whether a capture is running (the mechanism itself).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _inductor_options(module: nn.Module) -> dict:
    """The inductor options ``module.compile(...)`` or ``torch.compile(module)`` gave
    it ({} when not compiled or its backend has none). Read off the compiled call's
    backend, which wraps the inductor wrapper that holds them; an unknown shape reads
    as {} (no refusal)."""
    contexts = [getattr(module, "dynamo_ctx", None)]  # torch.compile(module)
    fn = getattr(module, "_compiled_call_impl", None)  # module.compile()
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            contexts.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for context in contexts:
        backend = getattr(context, "callback", None)
        for _ in range(4):
            backend = getattr(backend, "_torchdynamo_orig_backend", None)
            if isinstance(getattr(backend, "config", None), dict):
                return backend.config
    return {}


def _globally_on() -> bool:
    inductor = sys.modules.get("torch._inductor.config")  # never imported from here
    return bool(inductor is not None and inductor.triton.cudagraphs)


_FIX = ("compile without CUDA graphs (mode 'default' or 'max-autotune-no-cudagraphs') "
        "or use reshard_after_forward=False (Z2)")


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (never asked on the CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_not_capturing(device: torch.device, boundary: str, action: str) -> None:
    """The mechanism itself: a Z3 gather or free inside a CUDA graph capture, whatever
    set the capture up (a compile wrapper above the model, ``torch.cuda.graph``,
    ``make_graphed_callables``), would bake the storage's address of this step into the
    graph. One flag read on the host per call; no sync."""
    if _capturing(device):
        raise RuntimeError(
            f"DMuon-Z3 {action} the packed buffer of '{boundary}' while a CUDA graph is "
            "being captured: Z3 reallocates that storage every step, so the graph would "
            f"replay stale addresses; {_FIX}")


def _graphed(module: nn.Module) -> bool:
    return bool(_inductor_options(module).get("triton.cudagraphs"))


def _enclosing_modules():
    """Modules whose call is on the Python stack: a ``torch.compile`` wrapper above the
    dedicated model (``torch.compile(model)``) is not in its module tree."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            yield "the module compiled around the model", owner
        frame = frame.f_back


def _wrapping(root: nn.Module | None, boundaries: set[int]):
    """Modules of ``root``'s tree that contain a boundary module: a block wrapped by
    ``torch.compile`` after ``dedicate_params`` is the boundary's parent."""
    for name, module in root.named_modules() if root is not None else ():
        if _graphed(module) and any(id(m) in boundaries for m in module.modules()):
            yield name or "the model", module


def _refuse(where: str) -> ValueError:
    return ValueError(
        f"'{where}' is compiled with CUDA graphs (torch.compile mode "
        f"{' or '.join(CUDA_GRAPH_MODES)}), and DMuon-Z3 reallocates its packed buffers "
        f"every step, so the graph's parameter addresses would go stale; {_FIX}")


def check_no_cuda_graphs(modules, reshard_after_forward: bool, root=None) -> None:
    """Refuse a Z3 boundary compiled with CUDA graphs: its module or a submodule, a
    module of the model around it, or a compiled wrapper around the whole model."""
    if not reshard_after_forward:
        return
    if _globally_on():
        raise ValueError("torch._inductor.config.triton.cudagraphs is on, and DMuon-Z3 "
                         "reallocates its packed buffers every step, which a CUDA graph "
                         "cannot follow; use reshard_after_forward=False (Z2)")
    modules = list(modules)
    for name, module in modules:
        for sub_name, sub in module.named_modules():
            if _graphed(sub):
                raise _refuse(f"{name}.{sub_name}" if sub_name else name)
    for where, module in [*_wrapping(root, {id(m) for _, m in modules}),
                          *_enclosing_modules()]:
        if _graphed(module):
            raise _refuse(where)
