"""A job's export (``<storage>/<job>/export``) back in one process, for inference or a
check: the built-in model rebuilt from the dims its ``config.json`` records, a factory
model from its import path and kwargs, then every tensor of the safetensors shards
loaded by name. Hugging Face exports load with ``transformers``' ``from_pretrained``.

    from service.job.models.exported import load_exported
    model = load_exported("dmuon_runs/first-1a2b3c4d/export")   # an nn.Module, eval mode
    logits = model(tokens)                                       # [B, T] -> [B, T, vocab]
"""

from __future__ import annotations

import importlib
import json
import os

import torch
from torch import nn

from ..spec.presets import ModelConfig
from .builtin import build_model
from .dtypes import DTYPES

INDEX = "model.safetensors.index.json"


def exported_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the export, by its name, from the shards the index lists."""
    from safetensors.torch import load_file

    with open(os.path.join(path, INDEX)) as fh:
        files = sorted(set(json.load(fh)["weight_map"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(os.path.join(path, name)))
    return tensors


def _empty_model(config: dict, device) -> nn.Module:
    """The built-in model on the meta device (it has no buffers: nothing to lose); a
    factory's built for real on ``device``, so buffers it makes keep their values."""
    dtype = DTYPES[config["dtype"]]
    if "builtin" in config:
        return build_model(ModelConfig(**config["builtin"]), dtype=dtype, device="meta")
    if "factory" in config:
        module_name, fn_name = config["factory"].split(":")
        factory = getattr(importlib.import_module(module_name), fn_name)
        return factory(**config.get("kwargs", {})).to(device=device, dtype=dtype)
    raise ValueError("config.json is a Hugging Face config: load this export with "
                     "transformers.AutoModelForCausalLM.from_pretrained")


def load_exported(path: str, device: str | torch.device = "cpu") -> nn.Module:
    """The exported model with its weights, on ``device``, in eval mode. Every parameter
    must be in the export and every exported tensor must be a parameter of the model
    (a tied LM head is the embedding's tensor, exported once)."""
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    model = _empty_model(config, device)
    tensors = exported_tensors(path)
    names = {name for name, _ in model.named_parameters()}  # a tied param named once
    missing = sorted(names - tensors.keys())
    unexpected = sorted(tensors.keys() - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{path} does not match its config.json's model: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict({k: v.to(device) for k, v in tensors.items()}, strict=False,
                          assign="builtin" in config)
    if getattr(getattr(model, "config", None), "tie_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight  # assign= broke the tie
    return model.eval()
