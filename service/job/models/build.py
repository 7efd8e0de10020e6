"""The job's model on the meta device, for any kind the spec names (built-in, Hugging
Face, a factory by import path), its initialisation rule, its forward to logits, and
per-block activation checkpointing."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

from ..spec import JobSpec
from ..spec.model_section import builtin_config
from .attention_logits import enable_qk_clip
from .builtin import build_model, init_builtin
from .params import ParamSplit, find_blocks, split_params
from .routing import routed_split
from .source import ModelSource


def _hf_class_and_config(spec: JobSpec, source: ModelSource, dtype: torch.dtype):
    import transformers

    fields = dict(source.config)
    arch = spec.model.architecture(fields)
    cls = getattr(transformers, arch) if arch else transformers.AutoModelForCausalLM
    if source.config_dir:
        config = transformers.AutoConfig.from_pretrained(source.config_dir,
                                                         **spec.model.config)
    else:
        config = cls.config_class(**fields)
    if dtype == torch.float64:
        # transformers 5 runs fused experts with torch._grouped_mm: no float64 kernel
        config._experts_implementation = "eager"
    config.use_cache = False
    return cls, config


def build_on_meta(spec: JobSpec, source: ModelSource, dtype: torch.dtype) -> nn.Module:
    """The model with every tensor on the meta device (nothing allocated)."""
    if source.kind == "builtin":
        return build_model(builtin_config(spec.model), dtype=dtype, device="meta")
    if source.kind == "hf":
        cls, hf_config = _hf_class_and_config(spec, source, dtype)
        with torch.device("meta"):
            if cls.__name__.startswith("Auto"):
                return cls.from_config(hf_config, dtype=dtype)
            return cls._from_config(hf_config, dtype=dtype)
    module_name, fn_name = spec.model.factory.split(":")
    factory = getattr(importlib.import_module(module_name), fn_name)
    with torch.device("meta"):
        model = factory(**spec.model.kwargs)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model.factory: {spec.model.factory} returned "
                        f"{type(model).__name__}, not an nn.Module")
    return model.to(dtype)


@dataclass
class PreparedModel:
    """The model as DMuon and FSDP2 see it: its repeated blocks and its param split."""

    model: nn.Module
    blocks: list[str]
    split: ParamSplit


def prepare_on_meta(spec: JobSpec, source: ModelSource, dtype: torch.dtype) -> PreparedModel:
    """Build on meta, apply per-block activation checkpointing, split the params: the one
    way the planner and the workers both make the model, so the FQNs the plan names are
    the ones the workers see (``checkpoint_wrapper`` renames a factory model's)."""
    model = build_on_meta(spec, source, dtype)
    if spec.optimizer.qk_clip is not None and source.kind == "hf":
        enable_qk_clip(model)  # the built-in model reports its max logits itself
    checkpoint_blocks(spec, source, model, find_blocks(model))
    split = split_params(model, muon_params=spec.dmuon.muon_params,
                         adamw_params=spec.dmuon.adamw_params,
                         hook_boundaries=spec.dmuon.hook_boundaries)
    if spec.dmuon.param_policy is not None:
        split = routed_split(model, split, spec)
    return PreparedModel(model, find_blocks(model), split)


def init_rule(source: ModelSource, model: nn.Module):
    """``init_fn`` for ``dmuon.materialize``: the built-in rule, Hugging Face's
    ``_init_weights``, or None (a block's ``init_weights()``/``reset_parameters()``)."""
    return {"builtin": init_builtin, "hf": getattr(model, "_init_weights", None)}.get(
        source.kind)


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` for token ids ``[B, T]`` whatever the model returns."""
    if hasattr(model, "_init_weights") and hasattr(model, "config"):  # Hugging Face
        # positions given: under sequence parallel the embedding's output is one
        # sequence shard, from which the model would count positions 0..T/tp
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return model(input_ids=tokens, position_ids=positions, use_cache=False).logits
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def compile_blocks(spec: JobSpec, model: nn.Module, blocks: list[str]) -> None:
    """``torch.compile`` per block in place (``block.compile()``: FQNs unchanged), after
    activation checkpointing and before DMuon and FSDP2, as torchtitan orders them."""
    if spec.compile.enabled:
        for fqn in blocks:
            model.get_submodule(fqn).compile(**spec.compile.options())


def checkpoint_blocks(spec: JobSpec, source: ModelSource, model: nn.Module,
                      blocks: list[str]) -> None:
    """Per-block activation checkpointing, before DMuon and FSDP2 are applied."""
    how = spec.activation_checkpointing
    if how == "none":
        return
    if source.kind == "builtin":
        model.model.activation_checkpointing = how
    elif source.kind == "hf":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": how == "reentrant"})
    else:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        impl = CheckpointImpl.REENTRANT if how == "reentrant" else CheckpointImpl.NO_REENTRANT
        for fqn in blocks:
            parent, _, leaf = fqn.rpartition(".")
            owner = model.get_submodule(parent)
            owner.register_module(leaf, checkpoint_wrapper(owner.get_submodule(leaf),
                                                           checkpoint_impl=impl))
