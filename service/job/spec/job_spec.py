"""The job spec: one pydantic schema shared by REST, the CLI and YAML/JSON/TOML files.

Torch-free, so the CLI and the API parse a spec without loading torch. Unknown fields are
rejected everywhere, types are strict (``steps: "5"`` is refused, not coerced), floats
must be finite, strings may not hold control characters or lone surrogates, and every
error carries its field path (``optimizer.lr``, ``model.dim``), so a bad spec is refused
before any worker starts.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from .data_section import DataSpec
from .field_types import (  # noqa: F401 - the spec's field types, re-exported
    Betas,
    Coefficients,
    Count,
    DtypeName,
    SpecError,
    StrictModel,
    either,
    text,
)
from .layout_section import ElasticSpec, LayoutSpec, ResourcesSpec  # noqa: F401 - re-exported
from .model_section import ModelRef, builtin_config, check_preset
from .presets import ModelConfig
from .recipe_section import (
    CheckpointSpec,
    CompileSpec,
    DMuonSpec,
    ExportSpec,
    MetricsSpec,
    PrecisionSpec,
    ScheduleSpec,
)

MAX_SEED = 2**32 - 1  # the data order is seeded with seed * 1_000_003 + step in int64
MAX_DATA_BYTES = 256 << 20  # a text corpus is read whole by every worker
NAME_LENGTH = 128
_Strict = StrictModel


class QKClipSpec(_Strict):
    """MuonClip's QK-clip (Kimi K2 report, section 2; ``dmuon.qk_clip``): after each step
    the q/k rows of attention heads whose max logit went over ``tau`` are scaled down."""

    tau: float = Field(100.0, gt=0, le=1e9, description="the max logit a head may keep "
                       "(the Kimi K2 report's 100)")


class OptimizerSpec(_Strict):
    """Exactly ``dmuon.Muon``'s keyword options and defaults; dtypes by name."""

    lr: float = Field(0.02, ge=0)
    momentum: float = Field(0.95, ge=0, lt=1)
    nesterov: bool = True
    weight_decay: float = Field(0.0, ge=0)
    ns_steps: int = Field(5, ge=1, le=99)
    ns_backend: Literal["gram", "standard", "direct"] = "gram"
    ns_coefficients: either(lambda v: "named" if isinstance(v, str) else "abc",
                            named=Literal["quintic", "polar_express"],
                            abc=Coefficients) = "quintic"
    ns_dtype: DtypeName | None = Field(
        None, description="NS compute dtype (default: by device, as dmuon.Muon)")
    ns_gram_dtype: DtypeName | None = Field(
        None, description="Gram NS's m x m iteration (default: ns_dtype)")
    eps: float = Field(1e-7, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None
    variant: Literal["muon", "normuon"] = Field(
        "muon", description="normuon: each row of the update normalised by its running "
        "second moment, the update's norm kept (arXiv 2510.05491)")
    beta2: float = Field(0.95, ge=0, lt=1, description="NorMuon's second-moment decay")
    qk_clip: QKClipSpec | None = Field(None, description="QK-clip: {tau: 100}; the "
                                       "model's attention must report its max logits")
    adamw_lr: float = Field(1e-3, ge=0)
    adamw_betas: Betas = (0.9, 0.95)
    adamw_eps: float = Field(1e-8, gt=0)
    adamw_weight_decay: float = Field(0.0, ge=0)
    replicate_async: bool = True
    skip_nonfinite: bool = Field(True, description="skip a step whose gradients are not "
                                 "finite on some rank, on every rank alike")


class JobSpec(_Strict):
    name: text(NAME_LENGTH, 1) = "dmuon-job"
    model: ModelRef = "tiny"
    data: DataSpec = Field(default_factory=DataSpec)
    steps: int = Field(50, ge=1, le=1 << 30)
    batch_size: int = Field(4, ge=1, le=1 << 20,
                            description="sequences per data-parallel rank per micro-batch")
    seq_len: int = Field(64, ge=2, le=1 << 20,
                         description="at most the model's max_seq_len")
    global_batch_tokens: int | None = Field(
        None, ge=1, le=1 << 40, description="tokens per optimizer step; a multiple of "
        "batch_size x seq_len x data-parallel ranks, accumulated (null: one micro-batch)")
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    clip_grad_norm: float | None = Field(1.0, gt=0, le=1e9,
                                         description="global max norm (null: no clipping)")
    max_nonfinite_steps: int = Field(
        3, ge=0, le=1 << 20, description="consecutive steps skipped for a non-finite "
        "gradient (optimizer.skip_nonfinite) before the job fails naming the step, the "
        "ranks and the last good checkpoint")
    activation_checkpointing: Literal["none", "reentrant", "non_reentrant"] = "none"
    compile: CompileSpec = Field(default_factory=CompileSpec)
    dmuon: DMuonSpec = Field(default_factory=DMuonSpec)
    layout: LayoutSpec = Field(default_factory=LayoutSpec)
    resources_per_worker: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    working_dir: text(256, 1) | None = Field(
        None, description="the job's code (a factory module): an uploaded package id "
                          "(POST /v1/packages, `dmuon-svc submit --working-dir DIR`) or a "
                          "Ray package URI (gcs://_ray_pkg_<hash>.zip)")
    max_failures: int = Field(0, ge=-1, le=1000, description="-1: retry forever")
    seed: int = Field(0, ge=0, le=MAX_SEED)

    @field_validator("model")
    @classmethod
    def _known_model(cls, v):
        return check_preset(v)

    @field_validator("clip_grad_norm", mode="before")
    @classmethod
    def _clip_off_is_null(cls, v):
        """0 reads as "no clipping" to some; the spec says that with null."""
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
            raise ValueError(f"{v} is not a max norm (> 0); null turns clipping off")
        return v

    @field_validator("seq_len")
    @classmethod
    def _fits_the_model(cls, v, info: ValidationInfo):
        model = info.data.get("model")  # absent when the model itself was refused
        longest = known_max_seq_len(model) if model is not None else None
        if longest is not None and v > longest:
            raise ValueError(f"{v} is beyond the model's max_seq_len={longest}")
        return v

    @model_validator(mode="after")
    def _warmup_within_steps(self):
        if self.schedule.warmup_steps > self.steps:
            raise ValueError(f"schedule.warmup_steps={self.schedule.warmup_steps} exceeds "
                             f"steps={self.steps}")
        return self

    @model_validator(mode="after")
    def _elastic_needs_a_fixed_batch_and_checkpoints(self):
        if self.layout.elastic is None:
            return self
        if self.global_batch_tokens is None:
            raise ValueError("layout.elastic needs global_batch_tokens: the tokens per "
                             "step stay the same on every layout")
        if self.global_batch_tokens % self.seq_len:
            raise ValueError(f"global_batch_tokens={self.global_batch_tokens} is not a whole "
                             f"number of sequences of seq_len={self.seq_len}")
        if self.checkpoint.interval == 0:
            raise ValueError("layout.elastic needs checkpoint.interval > 0: a resized job "
                             "resumes from its last committed checkpoint")
        return self

    @model_validator(mode="after")
    def _no_cuda_graphs_under_z3(self):
        """CUDA graphs replay captured addresses; Z3 reallocates DMuon's packed buffers
        every step (``dmuon.cuda_graphs``), and ``auto`` may choose Z3."""
        mode = self.compile.mode
        if self.compile.enabled and mode in ("reduce-overhead", "max-autotune") \
                and self.dmuon.mode != "z2":
            raise _refused(("compile", "mode"), mode, (
                f"compile.mode={mode} captures CUDA graphs, which need stable parameter "
                f"addresses, and dmuon.mode={self.dmuon.mode} (Z3 frees and reallocates the "
                "packed buffers every step) is refused with them; set dmuon.mode: z2 or "
                "compile.mode: max-autotune-no-cudagraphs"))
        return self

    @model_validator(mode="after")
    def _tp_starts_from_an_init(self):
        if self.layout.tp != 1 and getattr(self.model, "weights", None) is not None:
            raise ValueError(f"layout.tp={self.layout.tp} with model.weights: loading "
                             "weights into tensor-parallel shards is not supported yet; "
                             "set layout.tp: 1")
        return self

    def llama_config(self) -> ModelConfig:
        config = builtin_config(self.model)
        if config is None:
            raise ValueError("not a built-in model")
        return config


def _refused(loc: tuple, value, message: str) -> ValidationError:
    """A refusal at ``loc`` (``spec.<loc>`` in a 422), for a check that reads several
    fields: raised from a model validator, pydantic keeps its location."""
    return ValidationError.from_exception_data("JobSpec", [InitErrorDetails(
        type=PydanticCustomError("value_error", message), loc=loc, input=value)])


def known_max_seq_len(model) -> int | None:
    """The model's longest sequence when the spec alone tells it (a file-based Hugging
    Face config is read later, by service.job.inputs)."""
    config = builtin_config(model)
    if config is not None:
        return config.max_seq_len
    if hasattr(model, "factory"):
        return model.max_seq_len
    return model.config.get("max_position_embeddings")


def field_path(loc) -> str:
    """``spec.model.dim``, ``spec.dmuon.param_policy.overrides[0].name``: a location as
    the user wrote it, without union tags."""
    path = ""
    for p in loc:
        if isinstance(p, int):
            path += f"[{p}]"
        elif not _union_tag(str(p)):
            path += f".{p}" if path else str(p)
    return path


def _union_tag(part: str) -> bool:
    """A union member's tag in pydantic's loc (``constrained-int``, ``literal['a']``,
    ``int``, ``<lambda>``): never a field name, which is an identifier."""
    return (part.startswith(("<", "constrained-", "function-", "lax-", "json-or-python"))
            or _TAG_WITH_ARGS.match(part) is not None or part in _SCALAR_TAGS)


_TAG_WITH_ARGS = re.compile(r"^[a-z-]+\[")  # literal['a'], nullable[int], list[int]
_SCALAR_TAGS = {"int", "float", "str", "bool", "none"}


_NAMED = re.compile(r"(?:Value error, )?([a-z_][a-z0-9_]*((?:\.[a-z0-9_]+)*))(?=(\s*[:=])|\s|$)")


def named_field(message: str) -> str | None:
    """The spec field a message names first (``layout.tp`` in ``layout.tp = 3 does not
    divide ...``, ``steps`` in ``steps: ...``): a field path at its head, with a dot or
    followed by ``:`` or ``=`` (not an English word that happens to be a field), whose
    first part is a field of the spec. None when it names none."""
    match = _NAMED.match(message)
    if match is None or not (match.group(2) or match.group(3)):
        return None
    path = match.group(1)
    return path if path.split(".", 1)[0] in JobSpec.model_fields else None


def format_errors(err: ValidationError) -> str:
    return "; ".join(f"{field_path(e['loc']) or '<root>'}: {e['msg']}" for e in err.errors())


def parse_spec(data: Any) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"invalid job spec: {format_errors(e)}",
                        fields=[f"spec.{field_path(x['loc']) or '<root>'}: {x['msg']}"
                                for x in e.errors()]) from None


def load_spec(path: str | pathlib.Path) -> JobSpec:
    """A spec from a YAML, JSON or TOML file, by its extension (``service.job.spec.spec_files``:
    a file that does not parse is a ``SpecFileError`` naming its line and column)."""
    from .spec_files import read_spec_file

    return parse_spec(read_spec_file(path))
