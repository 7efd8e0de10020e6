"""The spec's ``model`` section: a built-in preset or explicit dimensions, a Hugging Face
causal LM from a config, or a user's model by import path.

    model: small                                   # preset
    model: {dim: 128, n_layers: 2, ...}            # built-in Llama, explicit dims
    model: {dim: 128, ..., experts: 8, top_k: 2}   # built-in mixture of experts
    model: {hf: models/llama-tiny}                 # config.json (or a dir with one)
    model: {hf_arch: Qwen3MoeForCausalLM, config: {...}, weights: ckpt/}
    model: {factory: "mypkg.models:build", kwargs: {...}}
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .field_types import DataPath, StrictModel, either, text
from .presets import PRESETS, ModelConfig

CONFIG_FIELDS = 512  # a Hugging Face config has a few dozen fields


class ModelDims(StrictModel):
    """Explicit dimensions of a built-in Llama-style model."""

    # upper bounds well above Llama-3 405B keep a plan on the meta device quick
    vocab_size: int = Field(256, ge=2, le=1 << 20)
    dim: int = Field(ge=8, le=1 << 16)
    n_layers: int = Field(ge=1, le=1024)
    n_heads: int = Field(ge=1, le=1024)
    n_kv_heads: int = Field(ge=1, le=1024)
    ffn_dim: int = Field(ge=1, le=1 << 20)
    max_seq_len: int = Field(2048, ge=2, le=1 << 20)
    experts: int = Field(0, ge=0, le=1 << 16, description="experts per layer (0: dense MLP)")
    top_k: int = Field(2, ge=1, le=1 << 16, description="experts per token")
    moe_ffn_dim: int = Field(0, ge=0, le=1 << 20, description="an expert's hidden size "
                                                              "(0: ffn_dim)")

    @model_validator(mode="after")
    def _consistent(self):
        ModelConfig(**self.model_dump())  # its divisibility checks, as a 422
        return self


class HFModelSpec(StrictModel):
    """A ``transformers`` causal LM built from its config on the meta device."""

    hf: DataPath | None = Field(None, description="a config.json, or a directory with "
                                                  "one, under the data root")
    hf_arch: text(128, 1) | None = Field(None, description="e.g. LlamaForCausalLM; with "
                                                           "`config` when there is no file")
    config: dict[text(128, 1), Any] = Field(default_factory=dict, max_length=CONFIG_FIELDS,
                                            description="config fields (over the file's)")
    weights: DataPath | None = Field(None, description="a directory of *.safetensors to "
                                                       "start from (else _init_weights)")

    @model_validator(mode="after")
    def _one_source(self):
        if self.hf is None and self.hf_arch is None:
            raise ValueError("give hf (a config.json) or hf_arch with config")
        return self

    def architecture(self, fields: dict) -> str | None:
        """The ``transformers`` class to build: ``hf_arch``, else the config's first
        ``architectures`` entry (None: let ``AutoModelForCausalLM`` choose)."""
        return self.hf_arch or (fields.get("architectures") or [None])[0]


class FactoryModelSpec(StrictModel):
    """``factory(**kwargs)`` returns an ``nn.Module`` whose forward maps token ids
    ``[B, T]`` to logits ``[B, T, V]`` (or an output with ``.logits``). The module must
    be importable on the workers (ship it with the job's working_dir)."""

    factory: text(256, 3) = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                                  description="'package.module:function'")
    kwargs: dict[text(128, 1), Any] = Field(default_factory=dict, max_length=CONFIG_FIELDS)
    vocab_size: int | None = Field(None, ge=2, le=1 << 24,
                                   description="checked against the data when given")
    max_seq_len: int | None = Field(None, ge=2, le=1 << 24,
                                    description="checked against seq_len when given")
    init: Literal["reset_parameters", "init_weights"] = Field(
        "reset_parameters", description="per-module rule dmuon.materialize runs (a block's "
                                        "init_weights() is used when it has one)")


def _model_kind(value) -> str:
    """The member of ``ModelRef`` a value is. Pydantic asks with the input (a string or
    a mapping) when validating and with the model instance when serializing."""
    if isinstance(value, str):
        return "preset"
    for kind, cls in (("factory", FactoryModelSpec), ("hf", HFModelSpec), ("dims", ModelDims)):
        if isinstance(value, cls):
            return kind
    if isinstance(value, dict) and "factory" in value:
        return "factory"
    if isinstance(value, dict) and ({"hf", "hf_arch"} & set(value)):
        return "hf"
    return "dims"


ModelRef = either(_model_kind, preset=text(64, 1), dims=ModelDims, hf=HFModelSpec,
                  factory=FactoryModelSpec)


def check_preset(value):
    if isinstance(value, str) and value not in PRESETS:
        raise ValueError(f"unknown model {value!r}; built-in models: {sorted(PRESETS)}")
    return value


def builtin_config(model) -> ModelConfig | None:
    """The built-in model's shapes, or None for Hugging Face and factory models."""
    if isinstance(model, str):
        return PRESETS[model]
    if isinstance(model, ModelDims):
        return ModelConfig(**model.model_dump())
    return None
