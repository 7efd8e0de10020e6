"""The Ray the direct driver starts itself (no ``RAY_ADDRESS``): its session and its
processes' temp files under one private directory, removed when the driver ends. Ray's
default, ``/tmp/ray/session_*``, and the dashboard's multiprocessing ``pymp-*``
directory, stayed behind after every run."""

from __future__ import annotations

import os
import shutil
import tempfile

PREFIX = "dmuon-drv-"  # short: Ray's socket paths under it must stay under 108 bytes


def init_local(ray, **kwargs) -> str:
    """``ray.init(**kwargs)`` with its session in a new private directory; that directory."""
    root = tempfile.mkdtemp(prefix=PREFIX)
    scratch = os.path.join(root, "tmp")
    os.makedirs(scratch)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = scratch  # for the processes Ray starts now, not for this one
    try:
        ray.init(_temp_dir=root, **kwargs)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
    return root


def shutdown_local(ray, root: str) -> None:
    """Stop the Ray ``init_local`` started, then remove its directory."""
    try:
        ray.shutdown()
    finally:
        if os.path.basename(root).startswith(PREFIX):
            shutil.rmtree(root, ignore_errors=True)
