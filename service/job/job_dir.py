"""Every file under a job's directory, ``<storage>/<job>/``, named in one place: the
control plane writes the spec, plan and token there; the driver, the controller and the
workers write records, checkpoints, logs of layouts and the export; everyone reads them
back by these names."""

from __future__ import annotations

import re

SPEC = "spec.json"  # the spec as stored (the runner writes it for the entrypoint)
PLAN = "plan.json"  # the plan the workers run
INPUTS = "inputs.json"  # the inputs the control plane resolved, once, for the driver
JOB_TOKEN = "job_token"  # the job's own token for posting its records
METRICS = "metrics.jsonl"  # one record per (step, rank), from the controller
RANK_RECORDS = "rank_records"  # each rank's records as it wrote them (rank_R.jsonl)
LAYOUTS = "layouts.jsonl"  # each start of the worker group
CHECKPOINTS = "dcp"  # committed step_NNNNNN directories
EXPORT = "export"  # sharded safetensors and config.json
TENSORBOARD = "tensorboard"  # event files
FAILURE = "failure.json"  # why the job failed, first writer wins
EXPORT_FAILURE = "failure-export.json"  # an export job's, apart from the job's own
STEP_DIR = re.compile(r"step_(\d+)")


def step_dir(step: int) -> str:
    """A committed checkpoint's directory name under ``CHECKPOINTS``."""
    return f"step_{step:06d}"

