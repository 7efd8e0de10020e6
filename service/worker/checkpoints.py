"""The job's checkpoints: when to save (every K steps and always the final step), which
to keep (the last M), where to resume from."""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

import dmuon
from service.job.job_dir import STEP_DIR, step_dir
from service.job.spec import JobSpec


def due(spec: JobSpec, step: int) -> bool:
    """Whether ``step`` (1-based, just finished) is checkpointed."""
    interval = spec.checkpoint.interval
    return bool(interval) and (step % interval == 0 or step == spec.steps)


def committed(root: str | None) -> list[str]:
    """Complete checkpoints under ``root``, oldest first (``save`` commits by rename)."""
    if not root or not os.path.isdir(root):
        return []
    done = sorted(d for d in os.listdir(root) if STEP_DIR.fullmatch(d)
                  and os.path.isfile(os.path.join(root, d, dmuon.checkpoint.MANIFEST)))
    return [os.path.join(root, d) for d in done]


def latest_committed(root: str | None) -> str | None:
    done = committed(root)
    return done[-1] if done else None


def save(spec: JobSpec, root: str, step: int, model, opt) -> str:
    """Save ``step`` and drop all but the newest ``keep_last`` (rank 0 deletes, after
    every rank has finished writing)."""
    path = os.path.join(root, step_dir(step))
    dmuon.checkpoint.save(path, model, opt, extra={"step": step})
    keep = spec.checkpoint.keep_last
    dist.barrier()
    if keep and dist.get_rank() == 0:
        for old in committed(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def resume(model, opt, root: str | None, resume_from: str | None = None) -> int:
    """Load the newest committed checkpoint of this job (``root``: a restart after a
    failure), else the one ``checkpoint.resume_from`` resolved to (another job's, on any
    layout); returns its step (0: neither, a fresh start)."""
    path = latest_committed(root) or resume_from
    if path is None:
        return 0
    return dmuon.checkpoint.load(path, model, opt)["step"]
