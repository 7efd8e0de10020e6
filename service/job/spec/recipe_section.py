"""The spec's training recipe: LR schedule, precision, checkpoints, export, metrics,
and DMuon's mode. Defaults are what a torchtitan user expects (clipping at 1.0, linear
warmup then cosine to 10%, fp32 masters)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .field_types import DtypeName, Regex, StrictModel, text
from .policy_section import ParamPolicySpec
from .tracking_section import MlflowSpec, WandbSpec

JOB_ID = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"  # the store's ids (service.control.auth.JOB_ID)


class ScheduleSpec(StrictModel):
    """The same factor multiplies both groups' learning rates (Muon's ``lr`` and AdamW's
    ``adamw_lr``): linear warmup from 0, then cosine (or WSD: constant, then a linear
    decay over the last ``decay_fraction`` of the steps) down to ``min_lr_ratio``."""

    warmup_steps: int = Field(0, ge=0, le=1 << 30)
    decay: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd only")
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class PrecisionSpec(StrictModel):
    """fp32 masters and optimizer state; ``param_dtype`` is what forward and backward
    compute in (and what the all-gathers move), ``reduce_dtype`` what gradients are
    reduced in (FSDP2's MixedPrecisionPolicy, handed to DMuon too)."""

    master_dtype: DtypeName = "float32"
    param_dtype: DtypeName | None = Field(None, description="null: master_dtype")
    reduce_dtype: DtypeName | None = Field(None, description="null: param_dtype")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any):
        # `precision: bfloat16` (the former whole-model field): that dtype everywhere
        if isinstance(data, str):
            if data not in ("float32", "float64", "bfloat16"):
                raise ValueError("float32, float64, bfloat16 or {master_dtype, "
                                 "param_dtype, reduce_dtype}")
            return {"master_dtype": data}
        return data

    @property
    def compute(self) -> str:
        return self.param_dtype or self.master_dtype

    @property
    def reduce(self) -> str:
        return self.reduce_dtype or self.compute

    @property
    def mixed(self) -> bool:
        return (self.compute, self.reduce) != (self.master_dtype, self.master_dtype)


class CheckpointSpec(StrictModel):
    interval: int = Field(0, ge=0, le=1 << 30,
                          description="steps between checkpoints (0: none); they go to "
                                      "<storage>/<job id>/dcp; the final step is always "
                                      "checkpointed when interval > 0")
    keep_last: int = Field(2, ge=0, le=1 << 20, description="0: keep every checkpoint")
    resume_from: text(512, 1) | None = Field(
        None, description="a job id (its newest committed checkpoint in <storage>/<id>/dcp) "
        "or a path with a '/' (a checkpoint, a directory of them, or a job directory, under "
        "the data root or the storage root): weights, optimizer state and step, on any "
        "layout; the job's own checkpoints, once it has any, come first")

    @field_validator("resume_from")
    @classmethod
    def _job_or_path(cls, v: str | None):
        if v is not None and "/" not in v and not re.fullmatch(JOB_ID, v):
            raise ValueError("a job id (letters, digits, '_', '.', '-') or a path with a '/'")
        if v is not None and ".." in v.split("/"):
            raise ValueError("a path without '..'")
        return v


class CompileSpec(StrictModel):
    """``torch.compile`` per block, as torchtitan applies it (after activation
    checkpointing, before DMuon and FSDP2): each block compiled in place
    (``block.compile()``, which keeps the params' FQNs, so the plan's names are the
    workers'); DMuon's and FSDP2's hooks run outside the compiled region. ``compile:
    true`` is ``{enabled: true}``."""

    enabled: bool = False
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    mode: Literal["default", "reduce-overhead", "max-autotune",
                  "max-autotune-no-cudagraphs"] | None = None
    fullgraph: bool = False
    dynamic: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any):
        return {"enabled": data} if isinstance(data, bool) else data

    def options(self) -> dict:
        """``torch.compile``'s keyword arguments."""
        return {"backend": self.backend, "mode": self.mode, "fullgraph": self.fullgraph,
                "dynamic": self.dynamic}


class ExportSpec(StrictModel):
    enabled: bool = Field(True, description="sharded safetensors + config.json in "
                                            "<storage>/<job id>/export at the end")
    dtype: DtypeName | None = Field(None, description="null: the master dtype")


class MetricsSpec(StrictModel):
    peak_tflops: float | None = Field(
        None, gt=0, le=1e6, description="per worker, for MFU (default: the GPU's dense "
                                        "bf16 peak when known; none on CPUs)")
    tensorboard: bool = Field(True, description="per-step scalars as TensorBoard event "
                                                "files under <storage>/<job>/tensorboard")
    mlflow: MlflowSpec | None = Field(None, description="the same scalars to an MLflow run")
    wandb: WandbSpec | None = Field(None, description="the same scalars to a W&B run")

    @field_validator("wandb", mode="before")
    @classmethod
    def _wandb_shorthand(cls, v: Any):
        # `wandb: true` is W&B with the defaults, `wandb: false` none
        return ({} if v else None) if isinstance(v, bool) else v

    def sinks(self) -> list[str]:
        """The sinks this spec turns on, by field name."""
        return [name for name in ("tensorboard", "mlflow", "wandb") if getattr(self, name)]


class DMuonSpec(StrictModel):
    """``mode``: DMuon's packed buffers freed after forward (z3) or kept (z2), or
    ``auto``, decided by the planner's memory model for the device. FSDP2's
    ``reshard_after_forward`` mirrors it unless set (the seeds' asymmetric configs)."""

    mode: Literal["auto", "z2", "z3"] = "z3"
    fsdp_reshard_after_forward: bool | None = None
    device_memory_gb: float | None = Field(
        None, gt=0, le=1 << 20, description="for auto (default: 80 per GPU worker, else "
                                            "the node's memory shared by its workers)")
    muon_params: Regex | None = Field(None, description="FQN regex: these params get Muon "
                                                        "(over the derived rule)")
    adamw_params: Regex | None = Field(None, description="FQN regex: these get AdamW")
    hook_boundaries: Regex | None = Field(None, description="module FQN regex of the hook "
                                                            "boundaries (default: the blocks)")
    param_policy: ParamPolicySpec | None = Field(
        None, description="pure DMuon: every param routed to muon, adamw (on an owner) or "
                          "sharded_adamw (FSDP2) by the reference's param_policy; replaces "
                          "muon_params and adamw_params")

    def fsdp_mode(self, dmuon_mode: str) -> str:
        """FSDP2's mode ("z2" or "z3") when DMuon runs in ``dmuon_mode``."""
        if self.fsdp_reshard_after_forward is None:
            return dmuon_mode
        return "z3" if self.fsdp_reshard_after_forward else "z2"

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any):
        moved = sorted({"ns_backend", "replicate_async"} & set(data)) \
            if isinstance(data, dict) else []
        if moved:
            raise ValueError(f"{', '.join(moved)} moved to the optimizer section "
                             f"(optimizer.{moved[0]}), with dmuon.Muon's other options")
        return data

    @model_validator(mode="after")
    def _one_rule(self):
        both = [f for f in ("muon_params", "adamw_params") if getattr(self, f) is not None]
        if self.param_policy is not None and both:
            raise ValueError(f"dmuon.param_policy: routes every param itself; leave out "
                             f"dmuon.{both[0]} (or the policy)")
        return self
