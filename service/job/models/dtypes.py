"""The spec's dtype names as torch dtypes, and the optimizer section as ``dmuon.Muon``
keyword arguments: the worker side of the torch-free spec."""

from __future__ import annotations

import torch

from ..spec import OptimizerSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}
DTYPE_OPTIONS = ("ns_dtype", "ns_gram_dtype")


def muon_kwargs(optimizer: OptimizerSpec) -> dict:
    """``dmuon.Muon(model, **muon_kwargs(spec.optimizer))``."""
    options = optimizer.model_dump()
    for name in DTYPE_OPTIONS:
        options[name] = DTYPES[options[name]] if options[name] is not None else None
    options["qk_clip"] = options["qk_clip"]["tau"] if options["qk_clip"] else None
    return options
