"""A Hugging Face causal LM built from a config in float64, on the meta device or
initialised in one process by its own ``_init_weights`` under ``dmuon.init_weights``
(the values ``dmuon.materialize`` gives the same seed)."""

from __future__ import annotations

import torch

import dmuon


def hf_causal_lm(class_name: str, config: dict, *, seed: int, device=None):
    import transformers

    cls = getattr(transformers, class_name)
    hf_config = cls.config_class(**config)
    if device == "meta":
        with torch.device("meta"):
            return cls._from_config(hf_config, dtype=torch.float64)
    model = cls._from_config(hf_config, dtype=torch.float64)
    dmuon.init_weights(model, seed=seed, init_fn=model._init_weights)
    return model
