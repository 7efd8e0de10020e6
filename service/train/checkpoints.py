"""The job's checkpoints: when to save (every K steps and always the final step), which
to keep (the last M), where to resume from, and each checkpointed step's records, kept
before the checkpoint commits."""

from __future__ import annotations

import json
import os
import shutil

import torch.distributed as dist

import dmuon

from ..spec import JobSpec

# <job>/checkpoint_records/rank_<R>.jsonl; the control plane reads it by the same name
# (service.api.records.CHECKPOINT_RECORDS)
CHECKPOINT_RECORDS = "checkpoint_records"


def due(spec: JobSpec, step: int) -> bool:
    """Whether ``step`` (1-based, just finished) is checkpointed."""
    interval = spec.checkpoint.interval
    return bool(interval) and (step % interval == 0 or step == spec.steps)


def committed(root: str | None) -> list[str]:
    """Complete checkpoints under ``root``, oldest first (``save`` commits by rename)."""
    if not root or not os.path.isdir(root):
        return []
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and "." not in d
                  and os.path.isfile(os.path.join(root, d, dmuon.checkpoint.MANIFEST)))
    return [os.path.join(root, d) for d in done]


def latest_committed(root: str | None) -> str | None:
    done = committed(root)
    return done[-1] if done else None


def keep_record(job_dir: str, record: dict) -> None:
    """This rank's record of a step about to be checkpointed, written before the
    checkpoint commits: a job stopped right after (a cancel) loses the reports still on
    their way to Ray Train's controller, but never the record of the step it could
    resume from; the control plane adds it when Ray says the job ended. One file per
    rank: appends from several hosts to one file on shared storage are not atomic."""
    folder = os.path.join(job_dir, CHECKPOINT_RECORDS)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{record['rank']:05d}.jsonl"), "a") as fh:
        fh.write(json.dumps(record) + "\n")


def save(spec: JobSpec, root: str, step: int, model, opt, *, record: dict | None = None,
         job_dir: str | None = None) -> str:
    """Save ``step`` and drop all but the newest ``keep_last`` (rank 0 deletes, after
    every rank has finished writing). With ``job_dir``, ``record`` is kept first."""
    if job_dir and record is not None:
        keep_record(job_dir, record)
    path = os.path.join(root, f"step_{step:06d}")
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
