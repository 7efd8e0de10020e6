"""The model a job trains, resolved once per submission by ``service.job.inputs``: its kind and
what building it reads. The one place the kinds are told apart (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class ModelSource(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["builtin", "hf", "factory"]
    config: dict | None = None  # a Hugging Face config's fields (kind "hf")
    config_dir: str | None = None  # the directory its config.json was read from
    weights: str | None = None  # a directory of *.safetensors to load after init


BUILTIN = ModelSource(kind="builtin")
