"""The pure-DMuon set-up of the routing tests: the reference guide's "practical LLM
policy" with the tests' model's names, and its hook boundaries."""

from __future__ import annotations

from helpers.model import DecoderLayer

PURE_POLICY = {
    "defaults": {"route": "muon"},
    "overrides": [
        {"name": ["embed_tokens", "lm_head"], "set": {"route": "sharded_adamw"}},
        {"name": ["norm", "ln_", ".bias"], "set": {"route": "adamw"}},
    ],
}


def pure_boundaries(model):
    """The decoder layers, and the final norm (called outside them)."""
    final_norm = model.model.norm
    return lambda m: isinstance(m, DecoderLayer) or m is final_norm
