"""CUDA graphs and Z3 do not mix: refuse them by name.

A CUDA graph replays the device addresses it captured. Z3 releases each packed buffer's
storage after the forward and allocates it again before the backward and the next
forward (``Boundary.free``), so a block compiled with CUDA graphs (``torch.compile``
modes ``reduce-overhead`` and ``max-autotune``, or inductor's ``triton.cudagraphs``)
would read parameters from addresses that no longer hold them, or re-record every
step. Z2 keeps the packed storage for the whole run (its addresses are stable).
"""

from __future__ import annotations

import sys

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


def check_no_cuda_graphs(modules, reshard_after_forward: bool) -> None:
    """Refuse a Z3 boundary whose module (or a submodule) is compiled with CUDA graphs."""
    if not reshard_after_forward:
        return
    if _globally_on():
        raise ValueError("torch._inductor.config.triton.cudagraphs is on, and DMuon-Z3 "
                         "reallocates its packed buffers every step, which a CUDA graph "
                         "cannot follow; use reshard_after_forward=False (Z2)")
    for name, module in modules:
        for sub_name, sub in module.named_modules():
            if _inductor_options(sub).get("triton.cudagraphs"):
                where = f"{name}.{sub_name}" if sub_name else name
                raise ValueError(
                    f"'{where}' is compiled with CUDA graphs (torch.compile mode "
                    f"{' or '.join(CUDA_GRAPH_MODES)}), and DMuon-Z3 reallocates its packed "
                    "buffers every step, so the graph's parameter addresses would go "
                    "stale; compile without CUDA graphs (mode 'default' or "
                    "'max-autotune-no-cudagraphs') or use reshard_after_forward=False (Z2)")
