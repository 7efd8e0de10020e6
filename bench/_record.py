"""Benchmark results as dated, tracked records: ``bench/results/<bench>_<machine>_<date>``
as Markdown (the printed table, what was run) and JSON (the numbers) side by side; into
``$OUT`` instead when it is set (a lent device's run, a test's temporary folder)."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform

RESULTS = pathlib.Path(__file__).parent / "results"


def machine() -> str:
    """This machine's kind, e.g. ``x86_64-2cpu``: records of one kind compare."""
    return f"{platform.machine()}-{len(os.sched_getaffinity(0))}cpu"


def write_record(bench: str, title: str, table: str, data: dict, notes: str = "") -> str:
    """Write the Markdown and JSON record of one run; returns the Markdown path."""
    day = datetime.date.today().isoformat()
    results = pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS
    stem = results / f"{bench}_{machine()}_{day}"
    results.mkdir(parents=True, exist_ok=True)
    header = f"# {title}\n\n{day}, {machine()}, `python -m bench.{bench}`\n\n"
    stem.with_suffix(".md").write_text(header + table + ("\n\n" + notes if notes else "") + "\n")
    stem.with_suffix(".json").write_text(json.dumps(
        {"bench": bench, "date": day, "machine": machine(), **data}, indent=1) + "\n")
    return str(stem.with_suffix(".md"))


def gb(n) -> str:
    """Bytes as GB with one decimal, a table cell."""
    return f"{n / 1e9:.1f}"


def moved(row: dict, dims: tuple[str, ...], fmt: str = ".1f") -> str:
    """``a / b / c``: a row's GB per step on ``dims`` (``row["bytes_per_step"]``)."""
    b = row["bytes_per_step"]
    return " / ".join(f"{b.get(d, 0) / 1e9:{fmt}}" for d in dims)
