"""Start from a local safetensors checkpoint (``model.weights``), sharded on load: each
rank reads only the slices it keeps (its shard column's matrices or slices of experts,
its FSDP2 rows), through ``safe_open(...).get_slice``, never a whole file. Keys are the
model's own parameter names (as ``export`` writes them)."""

from __future__ import annotations

import glob
import json
import os
from contextlib import ExitStack

import torch
from torch import nn

import dmuon
from dmuon.planning import canonical_fqn, is_dedicated
from service.job.layout import fsdp2_rows

from .export import INDEX


def _key_files(weights_dir: str) -> dict[str, str]:
    index = os.path.join(weights_dir, INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            return {k: os.path.join(weights_dir, f) for k, f in json.load(fh)["weight_map"].items()}
    from safetensors import safe_open

    out = {}
    for path in sorted(glob.glob(os.path.join(weights_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as fh:
            out.update({k: path for k in fh.keys()})
    return out


def _shard_rows(param) -> tuple[int, int]:
    """The rows of an FSDP2 (dim-0 sharded) param this rank keeps."""
    mesh = param.device_mesh
    return fsdp2_rows(param.shape[0], mesh.size(-1), mesh.get_local_rank(mesh.ndim - 1))


@torch.no_grad()
def load_weights(model: nn.Module, weights_dir: str) -> None:
    from safetensors import safe_open

    files = _key_files(weights_dir)
    state = dmuon.get_state(model)
    with ExitStack() as stack:
        handles: dict[str, object] = {}

        def read(key: str, lo=None, hi=None) -> torch.Tensor:
            if key not in files:
                raise KeyError(f"model.weights: no tensor {key!r} in {weights_dir}")
            path = files[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt"))
            part = handles[path].get_slice(key)
            return part[lo:hi] if lo is not None else part[:]

        for b in state.boundaries:
            for m in b.column:
                key = canonical_fqn(state.plan.params[m.fqn].param)
                lo, hi = m.experts if m.experts else (None, None)
                b.load_value(m, read(key, lo, hi))
            b.free()  # the next forward gathers the new values
        for name, param in model.named_parameters():
            if is_dedicated(param):
                continue
            key = canonical_fqn(name)
            if hasattr(param, "to_local"):
                lo, hi = _shard_rows(param)
                local = param.to_local()
                local[:hi - lo].copy_(read(key, lo, hi))
            else:
                param.copy_(read(key))
