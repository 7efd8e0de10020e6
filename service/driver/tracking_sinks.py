"""Where a job's per-step scalars go, on the Ray Train controller: TensorBoard event files,
an MLflow run, a Weights & Biases run. Each sink is ``log(step, scalars, walltime)``,
``flush()`` and ``close(status)`` (FINISHED, FAILED or KILLED); ``service.driver.tracking_callback``
hands every sink the same scalars of a step once, in step order.

Credentials come from each tool's own environment variables on the node that runs the
controller (``service.job.spec.tracking_section``); the spec holds none."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid

from service.job.job_dir import TENSORBOARD as TENSORBOARD_DIR

WANDB_DIR = "wandb"  # W&B writes <job>/wandb/{run,offline-run}-<time>-<id>/
PARAM_VALUE_LENGTH = 6000  # MLflow's limit on a param's value
PARAM_KEY = re.compile(r"[^\w./ :-]")  # what MLflow refuses in a param's name
# a W&B run's exit code for the job's status: a stopped job's is a shell's for Ctrl-C
EXIT_CODES = {"FINISHED": 0, "FAILED": 1, "KILLED": 130}


class TensorBoardSink:
    """One event file under ``log_dir``, written synchronously with tensorboardX's
    ``EventsWriter`` (its ``SummaryWriter`` queues events for a thread that flushes
    every ``flush_secs``: a step could sit unwritten in a process that ends abruptly).
    After ``flush`` every step logged is on disk. The file's name carries the process
    and a random tag, so a second writer in the same second never truncates it."""

    name = "tensorboard"

    def __init__(self, log_dir: str):
        from tensorboardX.event_file_writer import EventsWriter

        os.makedirs(log_dir, exist_ok=True)
        self.writer = EventsWriter(os.path.join(log_dir, "events"),
                                   f".{os.getpid()}.{uuid.uuid4().hex[:8]}")
        self.closed = False

    def log(self, step: int, scalars: dict[str, float], walltime: float | None) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar

        if self.closed:
            return
        wall = time.time() if walltime is None else walltime
        for tag, value in scalars.items():
            self.writer.write_event(Event(wall_time=wall, step=step,
                                          summary=scalar(tag, value)))

    def flush(self) -> None:
        if not self.closed:
            self.writer.flush()

    def close(self, status: str = "FINISHED") -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()


def spec_params(spec: dict, prefix: str = "") -> dict[str, str]:
    """The spec as MLflow params: nested sections joined by ``.``, other values as JSON,
    within MLflow's limits on names and values."""
    out = {}
    for key, value in spec.items():
        name = PARAM_KEY.sub("_", f"{prefix}{key}")
        if isinstance(value, dict) and value:
            out.update(spec_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[name] = text[:PARAM_VALUE_LENGTH]
    return out


class MlflowSink:
    """One run in the spec's experiment (created when missing), named by the job id, the
    spec as its params; every step's scalars in one ``log_batch`` (MLflow splits more
    than 1000). The run ends with the job's status: FINISHED, FAILED or KILLED."""

    name = "mlflow"

    def __init__(self, settings, job_id: str, spec: dict):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=settings.tracking_uri)
        experiment = self._experiment(settings.experiment or spec["name"])
        run = self.client.create_run(experiment, run_name=job_id,
                                     tags={"dmuon_job_id": job_id})
        self.run_id, self.closed = run.info.run_id, False
        self.client.log_batch(self.run_id, params=[
            Param(k, v) for k, v in spec_params(spec).items()])

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another job created it meanwhile
            return self.client.get_experiment_by_name(name).experiment_id

    def log(self, step: int, scalars: dict[str, float], walltime: float | None) -> None:
        from mlflow.entities import Metric

        if self.closed:
            return
        stamp = int(1000 * (time.time() if walltime is None else walltime))
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, v, stamp, step) for k, v in scalars.items()])

    def flush(self) -> None:  # log_batch is synchronous
        pass

    def close(self, status: str = "FINISHED") -> None:
        if not self.closed:
            self.closed = True
            self.client.set_terminated(self.run_id, status)


class WandbSink:
    """One run in the spec's project, named by the job id, the spec as its config, its
    files under ``<job>/wandb``. W&B's console capture and end-of-run summary are off:
    the controller's stdout carries the job's JSON lines. W&B knows a run's end by its
    exit code alone (0: finished; else failed): ``EXIT_CODES``."""

    name = "wandb"

    def __init__(self, settings, job_id: str, spec: dict, job_dir: str):
        import wandb

        os.makedirs(os.path.join(job_dir, WANDB_DIR), exist_ok=True)
        self.run = wandb.init(
            project=settings.project, entity=settings.entity, mode=settings.mode,
            name=job_id, dir=job_dir, config=spec, reinit="create_new",
            settings=wandb.Settings(console="off", quiet=True))
        self.closed = False

    def log(self, step: int, scalars: dict[str, float], walltime: float | None) -> None:
        if not self.closed:
            self.run.log(scalars, step=step)

    def flush(self) -> None:  # W&B's own process writes the run's log
        pass

    def close(self, status: str = "FINISHED") -> None:
        """Finish the run, then end W&B's service process while it still answers: left
        to W&B's atexit hook, a stopped job's controller exits after the job's SIGTERM
        has reached that process, and the hook logs a ConnectionResetError traceback."""
        if not self.closed:
            import wandb

            self.closed = True
            self.run.finish(exit_code=EXIT_CODES[status])
            wandb.teardown(EXIT_CODES[status])


def sinks_for(metrics, job_dir: str, spec: dict) -> list:
    """The sinks ``metrics`` (the spec's section) turns on, opened; the job's id is its
    directory's name. One that cannot open is reported and left out (``dropped``)."""
    job_id = os.path.basename(os.path.normpath(job_dir))
    wanted = []
    if metrics.tensorboard:
        wanted.append(("tensorboard", lambda: TensorBoardSink(
            os.path.join(job_dir, TENSORBOARD_DIR))))
    if metrics.mlflow is not None:
        wanted.append(("mlflow", lambda: MlflowSink(metrics.mlflow, job_id, spec)))
    if metrics.wandb is not None:
        wanted.append(("wandb", lambda: WandbSink(metrics.wandb, job_id, spec, job_dir)))
    opened = []
    for name, open_sink in wanted:
        try:
            opened.append(open_sink())
        except Exception as e:  # any failure of a tool's client
            dropped(name, "could not open", e)
    return opened


def dropped(name: str, what: str, error: BaseException) -> None:
    """A sink that failed: one line on the job's log; training goes on, and
    ``metrics.jsonl`` and the control plane keep every record."""
    print(f"tracking: {name} {what} ({type(error).__name__}: {error}); no more scalars "
          f"go to {name} in this job", file=sys.stderr, flush=True)
