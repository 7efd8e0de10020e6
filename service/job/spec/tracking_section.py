"""The spec's experiment-tracking sinks beyond TensorBoard: MLflow and Weights & Biases.

Each is off unless its section is given; both receive the same per-step scalars as the
TensorBoard event files (``service.driver.tracking_callback``). Credentials never go in a spec (it
is stored and shown): MLflow reads ``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD`` /
``_TOKEN`` and W&B ``WANDB_API_KEY`` from the environment of the Ray node that runs the
job's Ray Train controller (the head node)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from .field_types import StrictModel, text

# the schemes MLflow's client takes for a tracking store: a server, or a database
TRACKING_SCHEMES = ("http", "https", "databricks", "sqlite", "postgresql", "mysql",
                    "mssql", "file")
# the module each sink imports, and the pin that provides it (pyproject.toml's extras)
SINK_PACKAGES = {"mlflow": ("mlflow", "mlflow-skinny==3.17.2"),
                 "wandb": ("wandb", "wandb==0.31.0")}


class MlflowSpec(StrictModel):
    """One MLflow run per job (named by the job id, tagged ``dmuon_job_id``), with the
    spec as its params."""

    tracking_uri: text(512, 1) = Field(
        description="an MLflow tracking server (http://host:5000) or a tracking database "
                    "(sqlite:///path, postgresql://host/db), as MLflow's client takes it")
    experiment: text(256, 1) | None = Field(None, description="null: the job's name")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, v: str):
        parts = urlsplit(v)
        scheme = (parts.scheme or v).split("+", 1)[0]  # databricks; postgresql+psycopg://
        if scheme not in TRACKING_SCHEMES:
            raise ValueError(f"a URI with one of the schemes {', '.join(TRACKING_SCHEMES)}")
        if parts.username is not None or parts.password is not None:
            raise ValueError("no credentials in the URI: the spec is stored and shown; "
                             "set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or "
                             "MLFLOW_TRACKING_TOKEN) on the Ray head node")
        return v


class WandbSpec(StrictModel):
    """One W&B run per job (named by the job id), with the spec as its config; its local
    files in ``<storage>/<job>/wandb``. ``wandb: true`` takes the defaults."""

    project: text(128, 1) = "dmuon"
    entity: text(128, 1) | None = Field(None, description="null: the API key's default")
    mode: Literal["online", "offline"] | None = Field(
        None, description="offline: the run stays in <storage>/<job>/wandb (`wandb sync` "
                          "uploads it later); null: WANDB_MODE, else online")
