"""The model ``python -m service.job.plan --model`` names: a built-in preset, one of the
records' MoE shapes (``moe_shapes``), or a Hugging Face config (a ``config.json`` or a
directory with one) read from this machine."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from ..models.source import ModelSource
from ..spec.presets import PRESETS
from .moe_shapes import BOUNDARIES, MOE_ARCH, MOE_SHAPES

SEQ_CAP = 8192  # the default --seq-len: the model's longest sequence, at most this


@dataclass
class PlannerModel:
    spec: object  # the spec's ``model`` field
    source: ModelSource | None  # None: a built-in model
    max_seq_len: int | None
    dmuon: dict = field(default_factory=dict)  # what the spec's dmuon section needs

    def default_seq_len(self) -> int:
        return min(self.max_seq_len or SEQ_CAP, SEQ_CAP)


def names() -> list[str]:
    return [*PRESETS, *MOE_SHAPES]


def planner_model(name: str) -> PlannerModel:
    """The model ``name`` says; a ``ValueError`` with the choices when it says none."""
    if name in PRESETS:
        return PlannerModel(name, None, PRESETS[name].max_seq_len)
    if name in MOE_SHAPES:
        config = MOE_SHAPES[name]
        # the experts' module its own hook boundary, as the workers need under EP
        return PlannerModel({"hf_arch": MOE_ARCH, "config": config},
                            ModelSource(kind="hf", config=config),
                            config["max_position_embeddings"],
                            {"hook_boundaries": BOUNDARIES})
    if os.path.exists(name):
        return _hf_file(name)
    raise ValueError(f"--model: {name!r} is no model name ({', '.join(names())}) and no "
                     "Hugging Face config.json or directory with one")


def _hf_file(path: str) -> PlannerModel:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as fh:
            config = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model: cannot read a Hugging Face config from {file}: "
                         f"{e}") from None
    arch = (config.get("architectures") or [None])[0]
    if not isinstance(config, dict) or arch is None:
        raise ValueError(f"--model: {file} names no architectures (e.g. LlamaForCausalLM)")
    longest = config.get("max_position_embeddings")
    if longest is None:
        import transformers

        cls = getattr(transformers, arch, None)
        longest = getattr(cls.config_class(), "max_position_embeddings", None) \
            if cls is not None else None
    return PlannerModel({"hf_arch": arch, "config": config},
                        ModelSource(kind="hf", config=config,
                                    config_dir=os.path.dirname(os.path.abspath(file))),
                        longest)
