"""MLflow and W&B read back with their own tools: a real ``mlflow server`` on a SQLite
backend and MLflow's client, and W&B's ``wandb leet inspect --json``, which prints the
records of an offline run's ``.wandb`` transaction log."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from helpers.servers import Server
from service.control.ray_head import free_port


class MlflowServer(Server):
    """``mlflow server`` with a SQLite backend under ``root``; the GenAI job runner is off
    (``huey`` is not installed: no job of this service uses it)."""

    def __init__(self, root: str):
        port = free_port()
        os.makedirs(root, exist_ok=True)
        super().__init__(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
             f"sqlite:///{root}/mlflow.db", "--default-artifact-root", f"{root}/artifacts",
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            f"http://127.0.0.1:{port}", "/health",
            env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            log=os.path.join(root, "server.log"))


def mlflow_run(tracking_uri: str, job_id: str):
    """The one MLflow run named ``job_id``, and ``{key: [(step, value)]}`` of its metrics
    in step order, as MLflow's client reads them."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    [run] = client.search_runs(experiments, f"tags.`dmuon_job_id` = '{job_id}'")
    history = {key: sorted((m.step, m.value) for m in client.get_metric_history(
        run.info.run_id, key)) for key in run.data.metrics}
    return run, history


def wandb_run(job_dir: str) -> tuple[list[dict], dict[str, list[tuple[int, float]]]]:
    """The records of the job's one W&B run (``<job>/wandb/*run-*``) and
    ``{key: [(step, value)]}`` of its history, user keys only (W&B's own start with _)."""
    [run_dir] = glob.glob(os.path.join(job_dir, "wandb", "*run-*"))
    wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run([wandb, "leet", "inspect", "--json", run_dir], capture_output=True,
                         text=True, timeout=60, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines()]
    history: dict[str, list[tuple[int, float]]] = {}
    for rec in records:
        if rec["type"] == "history":
            item = rec["history"]["item"]
            for key, value in item.items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((item["_step"], value))
    return records, history
