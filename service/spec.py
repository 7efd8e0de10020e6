"""The job spec: one pydantic schema shared by REST, the CLI and YAML/JSON files.

Unknown fields are rejected everywhere (``extra="forbid"``), and every validation error
carries its field path (``optimizer.lr``, ``layout.nodes``), so a bad spec is refused
before any worker starts.
"""

from __future__ import annotations

import json
import pathlib
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .models import PRESETS, ModelConfig

# the spec's dtype names, for `precision` and `optimizer.ns_dtype`/`ns_gram_dtype`
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelDims(_Strict):
    """Explicit dimensions of a built-in Llama-style model."""

    # upper bounds well above Llama-3 405B keep a plan on the meta device quick
    vocab_size: int = Field(256, ge=2, le=1 << 20)
    dim: int = Field(ge=8, le=1 << 16)
    n_layers: int = Field(ge=1, le=1024)
    n_heads: int = Field(ge=1, le=1024)
    n_kv_heads: int = Field(ge=1, le=1024)
    ffn_dim: int = Field(ge=1, le=1 << 20)
    max_seq_len: int = Field(2048, ge=2, le=1 << 20)

    @model_validator(mode="after")
    def _consistent(self):
        ModelConfig(**self.model_dump())  # its divisibility checks, as a 422
        return self


class DataSpec(_Strict):
    source: Literal["builtin"] | str = "builtin"  # the stdlib corpus, or a text file path
    val_every: int = Field(10, ge=0, description="validation loss every K steps (0: never)")
    val_batches: int = Field(2, ge=1)


class OptimizerSpec(_Strict):
    """Every ``dmuon.Muon`` option."""

    lr: float = Field(0.02, ge=0)
    momentum: float = Field(0.95, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = Field(0.0, ge=0)
    ns_steps: int = Field(5, ge=1, le=99)
    ns_coefficients: Literal["quintic", "polar_express"] | tuple[float, float, float] = "quintic"
    ns_dtype: Literal["bfloat16", "float32", "float64"] = "float32"
    ns_gram_dtype: Literal["float32", "float64"] | None = Field(
        None, description="Gram NS's m x m iteration (default: ns_dtype, not promoted)")
    eps: float = Field(1e-7, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    adamw_lr: float = Field(3e-3, ge=0)
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = Field(1e-8, gt=0)
    adamw_weight_decay: float = Field(0.0, ge=0)


class DMuonSpec(_Strict):
    mode: Literal["z2", "z3"] = "z3"
    ns_backend: Literal["standard", "gram"] = "gram"
    replicate_async: bool = True


class LayoutSpec(_Strict):
    """The R x N mesh: replicate across nodes, shard within a node, unless given."""

    nodes: int | Literal["auto"] = "auto"
    workers_per_node: int | Literal["auto"] = "auto"
    replicate: int | None = Field(None, ge=1, le=1024, description="R, overriding nodes")
    shard: int | None = Field(None, ge=1, le=1024,
                              description="N, overriding workers_per_node")

    @field_validator("nodes", "workers_per_node")
    @classmethod
    def _positive(cls, v):
        if v != "auto" and not 1 <= v <= 1024:
            raise ValueError("must be between 1 and 1024, or 'auto'")
        return v


class ResourcesSpec(_Strict):
    CPU: float = Field(1, ge=0)
    GPU: float = Field(0, ge=0)
    custom: dict[str, float] = Field(default_factory=dict)


class CheckpointSpec(_Strict):
    interval: int = Field(0, ge=0, description="steps between checkpoints (0: none)")
    storage_path: str | None = None


class JobSpec(_Strict):
    name: str = "dmuon-job"
    model: str | ModelDims = "tiny"
    data: DataSpec = Field(default_factory=DataSpec)
    steps: int = Field(50, ge=1)
    batch_size: int = Field(4, ge=1, le=1 << 20,
                            description="sequences per data-parallel rank")
    seq_len: int = Field(64, ge=2, le=1 << 20)
    precision: Literal["float32", "float64", "bfloat16"] = "float32"
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    dmuon: DMuonSpec = Field(default_factory=DMuonSpec)
    layout: LayoutSpec = Field(default_factory=LayoutSpec)
    resources_per_worker: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    max_failures: int = Field(0, ge=-1)
    seed: int = 0

    @field_validator("model")
    @classmethod
    def _known_model(cls, v):
        if isinstance(v, str) and v not in PRESETS:
            raise ValueError(f"unknown model {v!r}; built-in models: {sorted(PRESETS)}")
        return v

    def llama_config(self) -> ModelConfig:
        if isinstance(self.model, str):
            return PRESETS[self.model]
        return ModelConfig(**self.model.model_dump())


class SpecError(ValueError):
    """A spec that failed validation; the message lists every field path and reason."""


def format_errors(err: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in err.errors()
    )


def parse_spec(data: dict) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"invalid job spec: {format_errors(e)}") from None


def load_spec(path: str | pathlib.Path) -> JobSpec:
    """A spec from a YAML or JSON file."""
    text = pathlib.Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a job spec is a mapping, got {type(data).__name__}")
    return parse_spec(data)
