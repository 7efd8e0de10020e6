"""Memory accounting: live bytes per kind, found by walking this rank's own tensors."""

from __future__ import annotations

import torch
from torch import nn

from . import normuon
from .buffers import resident_bytes
from .model_state import get_state, is_dedicated

MEMORY_KINDS = ("packed_buffers", "owned_params", "momentum", "fsdp_shards", "adamw_state")


def _local_nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().nbytes() if local.numel() else 0


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Live bytes on this rank by kind (see ``MEMORY_KINDS``).

    ``owned_params`` counts the full values this rank keeps for its shard column (in
    ``param_dtype``; every replica of the column in HSDP) plus the owners' masters where
    they are a separate, higher-precision copy; ``packed_buffers`` the storage of the
    gather buffers alive right now.
    """
    state = get_state(model)
    report = dict.fromkeys(MEMORY_KINDS, 0)
    report["packed_buffers"] = state.live_packed_bytes()
    report["owned_params"] = sum(resident_bytes(b) for b in state.boundaries)
    report["fsdp_shards"] = sum(
        _local_nbytes(p) for p in model.parameters() if not is_dedicated(p)
    )
    if optimizer is not None:
        for s in optimizer.state.values():
            for key, value in s.items():
                if not isinstance(value, torch.Tensor) or value.ndim == 0:
                    continue
                # Muon's state at the owners (NorMuon's row moments with the momentum)
                muon = key in ("momentum_buffer", normuon.ROW_STATE)
                kind = "momentum" if muon else "adamw_state"
                report[kind] += _local_nbytes(value)
    return report


def communicator_report(model: nn.Module) -> dict:
    """DMuon's own process groups on this rank (``count``, ``groups`` as (name, ranks))
    and their device memory at ``process_groups.COMMUNICATOR_BYTES`` each under NCCL
    (``estimated_bytes``): no tensor holds it, so ``memory_report`` cannot see it."""
    return get_state(model).communicators.report()
