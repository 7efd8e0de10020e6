"""Reading a job spec file, by its extension: YAML (``.yaml``, ``.yml``), JSON
(``.json``) or TOML (``.toml``, through the standard library's ``tomllib``).

The one place spec files are parsed (``service.job.spec.load_spec``: the CLI and the job
entrypoint). A file that does not parse raises ``SpecFileError``, whose message names the
file, the line and the column (both counted from 1), e.g. ``job.yaml: line 3, column 9:
not valid YAML: mapping values are not allowed here``; the CLI and the entrypoint exit 2
on it. Torch-free, like the spec.
"""

from __future__ import annotations

import json
import pathlib
import re
import tomllib
from typing import Any

from .field_types import SpecError

FORMATS = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON", ".toml": "TOML"}
# tomllib's messages before Python 3.14, which adds lineno and colno to the error
_TOML_AT = re.compile(r"^(?P<msg>.*) \(at (?:line (?P<line>\d+), column (?P<col>\d+)|"
                      r"(?P<end>end of document))\)$", re.S)


class SpecFileError(SpecError):
    """A spec file that cannot be read as its format; ``line`` and ``column`` count from
    1 (None when the error has no place in the file, e.g. an unknown extension)."""

    def __init__(self, path, problem: str, line: int | None = None,
                 column: int | None = None):
        self.path, self.problem, self.line, self.column = str(path), problem, line, column
        where = f"line {line}, column {column}: " if line is not None else ""
        super().__init__(f"{path}: {where}{problem}")


def position(text: str, index: int) -> tuple[int, int]:
    """(line, column), from 1, of ``text[index]`` (``len(text)``: just past the end)."""
    line_start = text.rfind("\n", 0, index) + 1
    return text.count("\n", 0, index) + 1, index - line_start + 1


def _decode(path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        before = raw[:e.start].decode("utf-8-sig")
        raise SpecFileError(path, f"not UTF-8: byte {raw[e.start]:#04x} ({e.reason})",
                            *position(before, len(before))) from None


def _yaml(path, text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        problem = e.problem or e.context
        if e.problem and e.context and e.context_mark is not None:
            problem += (f" ({e.context} at line {e.context_mark.line + 1}, column "
                        f"{e.context_mark.column + 1})")
        place = (mark.line + 1, mark.column + 1) if mark is not None else ()
        raise SpecFileError(path, f"not valid YAML: {problem}", *place) from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow
        raise SpecFileError(path, f"not valid YAML: character U+{e.character:04X}: {e.reason}",
                            *position(text, e.position)) from None


def _json(path, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecFileError(path, f"not valid JSON: {e.msg}", e.lineno, e.colno) from None


def _toml(path, text: str) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        if getattr(e, "lineno", None) is not None:  # Python 3.14 and later
            raise SpecFileError(path, f"not valid TOML: {e.msg}", e.lineno,
                                e.colno) from None
        found = _TOML_AT.match(str(e))
        if found is None:
            raise SpecFileError(path, f"not valid TOML: {e}") from None
        line, column = (position(text, len(text)) if found["end"]
                        else (int(found["line"]), int(found["col"])))
        raise SpecFileError(path, f"not valid TOML: {found['msg']}", line, column) from None


_PARSERS = {"YAML": _yaml, "JSON": _json, "TOML": _toml}


def read_spec_file(path: str | pathlib.Path) -> dict:
    """The mapping a spec file holds, parsed as its extension says; ``SpecFileError``
    for an unknown extension, a file that does not parse, or one that is not a mapping.
    A file that cannot be read is a ``SpecFileError`` too, saying why."""
    fmt = FORMATS.get(pathlib.Path(path).suffix.lower())
    if fmt is None:
        raise SpecFileError(path, f"unknown spec format {pathlib.Path(path).suffix!r}: a "
                                  f"spec file ends in {', '.join(FORMATS)}")
    try:
        raw = pathlib.Path(path).read_bytes()
    except OSError as e:
        raise SpecFileError(path, f"cannot read the spec file: {e.strerror or e}") from None
    text = _decode(path, raw)
    data = _PARSERS[fmt](path, text)
    if data is None and fmt == "YAML":  # an empty YAML file: every default
        data = {}
    if not isinstance(data, dict):
        raise SpecFileError(path, f"a job spec is a mapping of fields, the {fmt} file "
                                  f"holds a {type(data).__name__}")
    return data
