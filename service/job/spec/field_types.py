"""Field types shared by the job spec's sections: bounded printable strings, unions
chosen by a discriminator, strict models, finite numbers, paths under the data root.

Torch-free: the CLI and the control plane parse specs without loading torch.
"""

from __future__ import annotations

import pathlib
import re
from typing import Annotated, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    StringConstraints,
    Tag,
)


def _printable(text: str) -> str:
    """Refuse what a store, a log line or a terminal cannot carry safely."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text):
        raise ValueError("must not contain control characters")
    return text



class SpecError(ValueError):
    """A spec that failed validation; the message lists every field path and reason, and
    ``fields`` (when validation gave them) holds one ``spec.<path>: reason`` per field."""

    def __init__(self, message: str = "", fields: list[str] | None = None):
        super().__init__(message)
        self.fields = fields or []

def text(max_length: int, min_length: int = 0):
    """A string field type: bounded, printable Unicode."""
    return Annotated[str, StringConstraints(min_length=min_length, max_length=max_length),
                     AfterValidator(_printable)]


def either(pick, **members):
    """A union whose member is chosen by ``pick(value)``; its tags (``<name>``) appear in
    error locations only, and ``field_path`` drops them."""
    return Annotated[Union[tuple(Annotated[t, Tag(f"<{k}>")] for k, t in members.items())],
                     Discriminator(lambda v: f"<{pick(v)}>")]


def _relative_path(source: str) -> str:
    parts = pathlib.PurePosixPath(source).parts
    if source.startswith("/") or ".." in parts or "\0" in source:
        raise ValueError("a path relative to the data root, without '..'")
    return source


def _regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"not a regular expression: {e}") from None
    return pattern


# a file, directory or glob under the data root (DMUON_DATA_ROOT); checked for existence
# before any worker starts (service.job.inputs)
DataPath = Annotated[text(512, 1), AfterValidator(_relative_path)]
Regex = Annotated[text(512, 1), AfterValidator(_regex)]
Count = either(lambda v: "auto" if v == "auto" else "count",
               count=Annotated[int, Field(ge=1, le=1024)], auto=Literal["auto"])
Real = Annotated[float, Strict()]
Beta = Annotated[float, Strict(), Field(ge=0, lt=1)]
# a list is how JSON and YAML write a tuple: the tuple is lax, its numbers are not
Betas = Annotated[tuple[Beta, Beta], Field(strict=False)]
Coefficients = Annotated[tuple[Real, Real, Real], Field(strict=False)]
DtypeName = Literal["bfloat16", "float16", "float32", "float64"]
# the short names the reference's policies use, as the spec's dtype names
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32", "fp64": "float64", "double": "float64"}


def _dtype_name(value):
    if isinstance(value, str) and value not in DTYPE_ALIASES and \
            value not in ("bfloat16", "float16", "float32", "float64"):
        raise ValueError(f"unknown dtype {value[:32]!r}: one of bfloat16 (bf16), float16 "
                         "(fp16), float32 (fp32), float64 (fp64)")
    return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


# a dtype by its name or short name (``bf16``), kept as its name
DtypeAlias = Annotated[DtypeName, BeforeValidator(_dtype_name)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
