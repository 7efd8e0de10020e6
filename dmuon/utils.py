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

__all__ = [
    "get_dedicated_params",
    "get_owned_params",
    "wait_all_post_step_broadcasts",
    "wait_all_reduces",
    "wait_all_replicate_broadcasts",
]
