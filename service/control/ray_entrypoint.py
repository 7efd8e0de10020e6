"""What the runner hands Ray for one job: the entrypoint's command line, with the
stored spec, plan and the job's own token written beside it, and the job's runtime
environment."""

from __future__ import annotations

import json
import os
import shlex

from service.job.inputs.working_dir import runtime_working_dir
from service.job.job_dir import JOB_TOKEN, PLAN, SPEC

FORWARDED_ENV = ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
# a job's log is a file the CLI and the dashboard read, never a terminal: Ray's process
# prefixes without colour codes. A cancel (Ray's stop_job) sends SIGTERM, on which the
# entrypoint aborts the run through Ray Train's controller, ending the trackers' runs;
# Ray's SIGKILL comes 3 s later by default, too soon for a W&B run to finish
JOB_ENV = {"RAY_COLOR_PREFIX": "0", "RAY_JOB_STOP_WAIT_TIME_S": "30"}


def runtime_env(job: dict, storage: str) -> dict:
    """The job's environment on Ray: forwarded variables, and its working_dir (an
    uploaded package's directory, which Ray's job API uploads, or a Ray URI)."""
    env = {"env_vars": {**{k: os.environ[k] for k in FORWARDED_ENV if k in os.environ},
                        **JOB_ENV}}
    if job["spec"].get("working_dir"):
        env["working_dir"] = runtime_working_dir(storage, job["spec"]["working_dir"])
    return env


def _driver_args(entrypoint: tuple, job: dict, storage: str, data_root: str) -> list[str]:
    job_dir = os.path.join(storage, job["id"])
    return [*entrypoint, "--spec", os.path.join(job_dir, SPEC),
            "--plan", os.path.join(job_dir, PLAN), "--storage", storage,
            "--data-root", data_root, "--job-id", job["id"]]


def entrypoint_command(entrypoint: tuple, job: dict, token: str, *, storage: str,
                       data_root: str, service_url: str) -> str:
    """``entrypoint``'s command line for the job (Ray runs it through a shell: every part
    quoted).
    The job gets the stored spec and plan, and its own token in a private file."""
    job_dir = os.path.join(storage, job["id"])
    os.makedirs(job_dir, exist_ok=True)
    for name, data in {SPEC: job["spec"], PLAN: job["plan"]}.items():
        with open(os.path.join(job_dir, name), "w") as fh:
            json.dump(data, fh)
    token_file = os.path.join(job_dir, JOB_TOKEN)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return shlex.join([
        *_driver_args(entrypoint, job, storage, data_root),
        "--metrics-url", f"{service_url}/v1/jobs/{job['id']}/metrics",
        "--plan-url", f"{service_url}/v1/jobs/{job['id']}/plan",
        "--token-file", token_file])


def export_command(entrypoint: tuple, job: dict, *, storage: str, data_root: str) -> str:
    """The command of a Ray job that rebuilds the finished job on its stored plan, loads
    its newest checkpoint and exports it."""
    return shlex.join([*_driver_args(entrypoint, job, storage, data_root), "--export-only"])
