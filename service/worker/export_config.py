"""``config.json`` beside the exported weights: Hugging Face's own config (so
``from_pretrained`` loads the directory), or what rebuilds a built-in or factory model."""

from __future__ import annotations

import dataclasses
import json
import os

from service.job.models.source import ModelSource
from service.job.spec import JobSpec
from service.job.spec.model_section import builtin_config


def config_writer(spec: JobSpec, source: ModelSource, model):
    """``write(directory)`` for ``export``, run on rank 0."""
    dtype = spec.export.dtype or spec.precision.master_dtype

    def write(directory: str) -> None:
        if source.kind == "hf":
            config = model.config
            config.dtype = dtype
            config.save_pretrained(directory)
            return
        data = ({"builtin": dataclasses.asdict(builtin_config(spec.model))}
                if source.kind == "builtin" else
                {"factory": spec.model.factory, "kwargs": spec.model.kwargs})
        with open(os.path.join(directory, "config.json"), "w") as fh:
            json.dump({**data, "dtype": dtype}, fh, indent=2, sort_keys=True)

    return write
