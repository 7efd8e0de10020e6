"""The walk of one submission, side by side: the files of ``service/`` and ``dmuon/`` in
the order the job runs through them, and how often it returns to a file it already
left (issue 51: the driver's ``main`` once entered 18 files with 19 returns).

It runs the traced submission of a job-path helper (``tests/helpers/job_path.py``, or
its older name in an earlier checkout) with one more profiler beside its own, that
walks as a reader would: each call from one function of ``service/`` or ``dmuon/`` to
another (not an import, not a module body) is followed once, the first time it runs,
and so is the return from it; a run of the same file counts once.

    python tests/helpers/job_walk.py HELPER.py DIR   # writes DIR/walk.json
"""

from __future__ import annotations

import collections
import importlib.util
import inspect
import json
import os
import sys


def _load(helper: str):
    spec = importlib.util.spec_from_file_location("job_path_helper", helper)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Walk:
    """The files in the order one side runs through them (consecutive repeats once)."""

    def __init__(self, helper):
        self.helper, self.side = helper, None
        self.order: dict[str, list[str]] = collections.defaultdict(list)
        self._edges: set = set()
        self._walked: set[int] = set()

    def _traced(self, frame) -> str | None:
        code = frame.f_code
        if not code.co_filename.startswith(self.helper.TRACED) \
                or not code.co_flags & inspect.CO_OPTIMIZED:
            return None
        return os.path.relpath(code.co_filename, self.helper.ROOT)

    def _caller(self, frame):
        frame = frame.f_back
        while frame is not None and self._traced(frame) is None:
            frame = frame.f_back
        return frame

    def see(self, frame, event) -> None:
        """A reader's walk: each call from one traced function to another followed once
        (its first time), and the return from it; a loop's repeats add nothing."""
        if self.side is None or event not in ("call", "return"):
            return
        here = self._traced(frame)
        if here is None or self.helper._importing(frame.f_back):
            return
        caller = self._caller(frame)
        if event == "call":
            edge = (None if caller is None else caller.f_code, frame.f_code)
            if edge in self._edges:
                return
            self._edges.add(edge)
            self._walked.add(id(frame))
            self._step(here)
        elif id(frame) in self._walked:
            self._walked.discard(id(frame))
            if caller is not None:
                self._step(self._traced(caller))

    def _step(self, now: str) -> None:
        order = self.order[self.side]
        if not order or order[-1] != now:
            order.append(now)

    def summary(self) -> dict:
        out = {}
        for side, order in self.order.items():
            seen = collections.Counter(order)
            out[side] = {"files": len(seen), "returns": len(order) - len(seen),
                         "most_entered": dict(seen.most_common(5)), "order": order}
        return out


def _sided(walk: Walk, side: str, fn):
    def run(*args, **kwargs):
        before, walk.side = walk.side, side
        try:
            return fn(*args, **kwargs)
        finally:
            walk.side = before
    return run


def main(helper_path: str, out: str) -> None:
    helper = _load(helper_path)
    walk = Walk(helper)
    traced_call = helper.Trace.__call__

    def call(self, frame, event, arg):
        traced_call(self, frame, event, arg)
        walk.see(frame, event)

    helper.Trace.__call__ = call
    helper.submit = _sided(walk, "control", helper.submit)
    helper.drive = _sided(walk, "driver", helper.drive)
    helper.RayTrain.fit = _sided(walk, "worker", helper.RayTrain.fit)
    helper.main(out)
    with open(os.path.join(out, "walk.json"), "w") as fh:
        json.dump(walk.summary(), fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
