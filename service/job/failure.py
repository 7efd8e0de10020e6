"""Why a job failed, in a few fields: the first exception on the first failing rank.

A worker that raises writes ``{type, message, rank, step, phase, frames, source, time}``
to the job's failure file (``<storage>/<job>/failure.json``) before Ray Train sees the
exception; the first writer wins (``O_CREAT | O_EXCL``), so ranks that fail afterwards,
because a peer left their collectives, cannot replace the cause. The entrypoint writes
one for the failures no worker could describe (a refused layout, a worker process that
died); the control plane stores it as the job's ``reason``. Torch-free, Ray-free.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback

MAX_FRAMES = 6
MAX_MESSAGE = 2000
# CSI sequences (colours, cursor moves) and the rarer OSC ones (titles, links)
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-_]")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')


def strip_ansi(text: str | None) -> str | None:
    """``text`` without terminal escape codes (Ray colours its log lines)."""
    return None if text is None else _ANSI.sub("", text)


def _clip(text: str, limit: int = MAX_MESSAGE) -> str:
    text = strip_ansi(text)
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


def frames_of(exc: BaseException) -> list[str]:
    """The innermost ``MAX_FRAMES`` frames as ``file:line in function``."""
    tb = traceback.extract_tb(exc.__traceback__)[-MAX_FRAMES:]
    return [f"{f.filename}:{f.lineno} in {f.name}" for f in tb]


def frames_from_text(text: str) -> list[str]:
    """The same frames read back from a formatted traceback (Ray ships them as text)."""
    found = [f"{m['file']}:{m['line']} in {m['fn']}" for m in
             (_FRAME.match(line) for line in strip_ansi(text).splitlines()) if m]
    return found[-MAX_FRAMES:]


def describe(exc: BaseException, *, rank: int | None, step: int | None,
             phase: str | None, source: str, frames: list[str] | None = None) -> dict:
    """The reason as stored: the exception's type and message, where it happened."""
    return {"type": type(exc).__name__, "message": _clip(str(exc)), "rank": rank,
            "step": step, "phase": phase,
            "frames": frames if frames is not None else frames_of(exc),
            "source": source, "time": time.time()}


def record_first(path: str, reason: dict) -> bool:
    """Write ``reason`` to ``path`` unless a reason is there already; True if written.
    Never raises: describing a failure must not hide it."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(reason))
    return True


def read_reason(path: str) -> dict | None:
    """The stored reason, or None (no file, or one still being written)."""
    try:
        with open(path) as fh:
            reason = json.load(fh)
    except (OSError, ValueError):
        return None
    return reason if isinstance(reason, dict) and reason.get("type") else None


_FIELDS = {"type": 200, "message": MAX_MESSAGE, "phase": 16, "source": 16}


def _text(value, limit: int) -> str | None:
    if not isinstance(value, str):
        return None
    return _clip(value.encode("utf-8", "replace").decode("utf-8"), limit)


def _count(value) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62
    return value if ok else None


def sanitized(raw) -> dict | None:
    """A reason the control plane can store and show: the known fields only, strings
    printable and bounded (the job's code could have written anything there)."""
    if not isinstance(raw, dict) or not _text(raw.get("type"), 200):
        return None
    reason = {k: _text(raw.get(k), n) for k, n in _FIELDS.items()}
    reason.update(rank=_count(raw.get("rank")), step=_count(raw.get("step")))
    frames = raw.get("frames") if isinstance(raw.get("frames"), list) else []
    reason["frames"] = [t for t in (_text(f, 500) for f in frames[-MAX_FRAMES:]) if t]
    when = raw.get("time")
    reason["time"] = float(when) if isinstance(when, int | float) and \
        not isinstance(when, bool) and 0 <= when < 1e11 else None
    return reason


def summary(reason: dict) -> str:
    """One line: ``RuntimeError: boom (rank 2, step 3)``."""
    where = [f"{k} {reason[k]}" for k in ("rank", "step") if reason.get(k) is not None]
    return f"{reason['type']}: {reason['message']}" + (f" ({', '.join(where)})"
                                                       if where else "")
