"""The spec's ``data`` section: the built-in corpus, a text file, or token shards.

Token shards are flat ``.bin`` files (``uint16``/``uint32``; a 256-int32 header as
``dmuon-svc prepare`` and llm.c write names its dtype, else ``dtype`` does) or ``.npy``
arrays, matched by a glob under the data root and read memory-mapped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .field_types import DataPath, StrictModel

TOKEN_SUFFIXES = (".bin", ".npy")


class DataSpec(StrictModel):
    source: DataPath = Field(
        "builtin", description="'builtin' (the stdlib corpus, bytes), a text file, or a "
                               "glob of token shards (*.bin, *.npy) under the data root "
                               "(DMUON_DATA_ROOT, default <storage>/data)")
    format: Literal["auto", "text", "tokens"] = Field(
        "auto", description="auto: tokens for .bin/.npy, else a text file read as bytes")
    dtype: Literal["uint16", "uint32"] | None = Field(
        None, description="token dtype of .bin shards without a header")
    val_source: DataPath | None = Field(
        None, description="held-out token shards (glob); else the last val_fraction of "
                          "every training shard")
    val_fraction: float = Field(0.05, gt=0, lt=1)
    val_every: int = Field(10, ge=0, le=1_000_000,
                           description="validation loss every K steps (0: never)")
    val_batches: int = Field(2, ge=1, le=1000)

    @property
    def tokens(self) -> bool:
        if self.format != "auto":
            return self.format == "tokens"
        return self.source != "builtin" and self.source.endswith(TOKEN_SUFFIXES)

    @model_validator(mode="after")
    def _consistent(self):
        if self.source == "builtin" and self.format == "tokens":
            raise ValueError("format: the built-in corpus is text")
        if self.val_source is not None and not self.tokens:
            raise ValueError("val_source: held-out shards go with token shards")
        return self
