"""The reference implementation's ``dmuon.utils`` names, for scripts that import them from
there: the same functions as ``dmuon.<name>``."""

from __future__ import annotations

from .model_state import (
    get_dedicated_params,
    get_owned_params,
    wait_all_post_step_broadcasts,
    wait_all_reduces,
    wait_all_replicate_broadcasts,
)
from .post_step import broadcast_all_updates, broadcast_all_updates_async, prepare_muon_grads

__all__ = [
    "broadcast_all_updates",
    "broadcast_all_updates_async",
    "prepare_muon_grads",
    "get_dedicated_params",
    "get_owned_params",
    "wait_all_post_step_broadcasts",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]
