"""The job spec: one pydantic schema shared by REST, the CLI and YAML/JSON files.

Torch-free, so the CLI and the API parse a spec without loading torch. Unknown fields are
rejected everywhere, types are strict (``steps: "5"`` is refused, not coerced), floats
must be finite, strings may not hold control characters or lone surrogates, and every
error carries its field path (``optimizer.lr``, ``model.dim``), so a bad spec is refused
before any worker starts.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    StringConstraints,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .model_config import PRESETS, ModelConfig

# dtype names of the spec; the worker maps them to torch dtypes (service.train.dtypes)
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
MAX_SEED = 2**32 - 1  # the data order is seeded with seed * 1_000_003 + step in int64
MAX_DATA_BYTES = 256 << 20  # a text corpus is read whole by every worker
NAME_LENGTH = 128


def _printable(text: str) -> str:
    """Refuse what a store, a log line or a terminal cannot carry safely."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text):
        raise ValueError("must not contain control characters")
    return text


def text(max_length: int, min_length: int = 0):
    """A string field type: bounded, printable Unicode."""
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length),
                     AfterValidator(_printable)]


def either(pick, **members):
    """A union whose member is chosen by ``pick(value)``; its tags (``<name>``) appear in
    error locations only, and ``field_path`` drops them."""
    return Annotated[Union[tuple(Annotated[t, Tag(f"<{k}>")] for k, t in members.items())],
                     Discriminator(lambda v: f"<{pick(v)}>")]


Count = either(lambda v: "auto" if v == "auto" else "count",
               count=Annotated[int, Field(ge=1, le=1024)], auto=Literal["auto"])
Real = Annotated[float, Strict()]
Beta = Annotated[float, Strict(), Field(ge=0, lt=1)]
# a list is how JSON and YAML write a tuple: the tuple is lax, its numbers are not
Betas = Annotated[tuple[Beta, Beta], Field(strict=False)]
Coefficients = Annotated[tuple[Real, Real, Real], Field(strict=False)]
DtypeName = Literal["bfloat16", "float16", "float32", "float64"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


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


def _relative_path(source: str) -> str:
    parts = pathlib.PurePosixPath(source).parts
    if source != "builtin" and (source.startswith("/") or ".." in parts or "\0" in source):
        raise ValueError("'builtin' or a path relative to the data root, without '..'")
    return source


class DataSpec(_Strict):
    source: Annotated[text(512, 1), AfterValidator(_relative_path)] = Field(
        "builtin", description="'builtin' (the stdlib corpus) or a text file under the "
                               "data root (DMUON_DATA_ROOT, default <storage>/data)")
    val_every: int = Field(10, ge=0, le=1_000_000,
                           description="validation loss every K steps (0: never)")
    val_batches: int = Field(2, ge=1, le=1000)


class OptimizerSpec(_Strict):
    """Exactly ``dmuon.Muon``'s keyword options and defaults; dtypes by name."""

    lr: float = Field(0.02, ge=0)
    momentum: float = Field(0.95, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = Field(0.0, ge=0)
    ns_steps: int = Field(5, ge=1, le=99)
    ns_backend: Literal["gram", "standard"] = "gram"
    ns_coefficients: either(lambda v: "named" if isinstance(v, str) else "abc",
                            named=Literal["quintic", "polar_express"],
                            abc=Coefficients) = "quintic"
    ns_dtype: DtypeName | None = Field(
        None, description="NS compute dtype (default: by device, as dmuon.Muon)")
    ns_gram_dtype: DtypeName | None = Field(
        None, description="Gram NS's m x m iteration (default: ns_dtype)")
    eps: float = Field(1e-7, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    adamw_lr: float = Field(1e-3, ge=0)
    adamw_betas: Betas = (0.9, 0.95)
    adamw_eps: float = Field(1e-8, gt=0)
    adamw_weight_decay: float = Field(0.0, ge=0)
    replicate_async: bool = True


class DMuonSpec(_Strict):
    mode: Literal["z2", "z3"] = "z3"

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any):
        moved = sorted({"ns_backend", "replicate_async"} & set(data)) \
            if isinstance(data, dict) else []
        if moved:
            raise ValueError(f"{', '.join(moved)} moved to the optimizer section "
                             f"(optimizer.{moved[0]}), with dmuon.Muon's other options")
        return data


class LayoutSpec(_Strict):
    """The R x N mesh: replicate across nodes, shard within a node, unless given."""

    nodes: Count = "auto"
    workers_per_node: Count = "auto"
    replicate: int | None = Field(None, ge=1, le=1024, description="R, overriding nodes")
    shard: int | None = Field(None, ge=1, le=1024,
                              description="N, overriding workers_per_node")


class ResourcesSpec(_Strict):
    CPU: float = Field(1, ge=0, le=1 << 20)
    GPU: float = Field(0, ge=0, le=1 << 10)
    custom: dict[text(64, 1), Annotated[float, Field(ge=0, le=1 << 30)]] = Field(
        default_factory=dict, max_length=16)


class CheckpointSpec(_Strict):
    interval: int = Field(0, ge=0, le=1 << 30,
                          description="steps between checkpoints (0: none); they go to "
                                      "<storage>/<job id>/dcp")


ModelRef = either(lambda v: "preset" if isinstance(v, str) else "dims",
                  preset=text(64, 1), dims=ModelDims)


class JobSpec(_Strict):
    name: text(NAME_LENGTH, 1) = "dmuon-job"
    model: ModelRef = "tiny"
    data: DataSpec = Field(default_factory=DataSpec)
    steps: int = Field(50, ge=1, le=1 << 30)
    batch_size: int = Field(4, ge=1, le=1 << 20,
                            description="sequences per data-parallel rank")
    seq_len: int = Field(64, ge=2, le=1 << 20,
                         description="at most the model's max_seq_len")
    precision: Literal["float32", "float64", "bfloat16"] = "float32"
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    dmuon: DMuonSpec = Field(default_factory=DMuonSpec)
    layout: LayoutSpec = Field(default_factory=LayoutSpec)
    resources_per_worker: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    max_failures: int = Field(0, ge=-1, le=1000, description="-1: retry forever")
    seed: int = Field(0, ge=0, le=MAX_SEED)

    @field_validator("model")
    @classmethod
    def _known_model(cls, v):
        if isinstance(v, str) and v not in PRESETS:
            raise ValueError(f"unknown model {v!r}; built-in models: {sorted(PRESETS)}")
        return v

    @field_validator("seq_len")
    @classmethod
    def _fits_the_model(cls, v, info: ValidationInfo):
        model = info.data.get("model")  # absent when the model itself was refused
        if model is not None:
            longest = (PRESETS[model] if isinstance(model, str) else model).max_seq_len
            if v > longest:
                raise ValueError(f"{v} is beyond the model's max_seq_len={longest}")
        return v

    def llama_config(self) -> ModelConfig:
        if isinstance(self.model, str):
            return PRESETS[self.model]
        return ModelConfig(**self.model.model_dump())


class SpecError(ValueError):
    """A spec that failed validation; the message lists every field path and reason."""


def field_path(loc) -> str:
    """``spec.model.dim``: a location as the user wrote it, without union tags."""
    return ".".join(str(p) for p in loc if not str(p).startswith("<"))


def format_errors(err: ValidationError) -> str:
    return "; ".join(f"{field_path(e['loc']) or '<root>'}: {e['msg']}" for e in err.errors())


def parse_spec(data: Any) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"invalid job spec: {format_errors(e)}") from None


def load_spec(path: str | pathlib.Path) -> JobSpec:
    """A spec from a YAML or JSON file."""
    text_ = pathlib.Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text_) or {}
    else:
        data = json.loads(text_)
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a job spec is a mapping, got {type(data).__name__}")
    return parse_spec(data)


def resolve_data_source(spec: JobSpec, data_root: str) -> str | None:
    """The corpus file a job will read (None: the built-in one): a regular file under
    ``data_root`` of at most MAX_DATA_BYTES. Raises SpecError with the reason."""
    source = spec.data.source
    if source == "builtin":
        return None
    root = os.path.realpath(data_root)
    path = os.path.realpath(os.path.join(root, source))
    if os.path.commonpath([root, path]) != root:
        raise SpecError(f"data.source: {source!r} leads outside the data root")
    try:
        info = os.stat(path)
    except OSError:
        raise SpecError(f"data.source: no file {source!r} under the data root "
                        f"{data_root}") from None
    if not stat.S_ISREG(info.st_mode):
        raise SpecError(f"data.source: {source!r} is not a regular file")
    if info.st_size > MAX_DATA_BYTES:
        raise SpecError(f"data.source: {source!r} has {info.st_size} bytes; at most "
                        f"{MAX_DATA_BYTES} are read")
    return path
