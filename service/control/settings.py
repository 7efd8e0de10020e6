"""The control plane's settings, from the environment (pydantic-settings).

``DMUON_API_TOKEN`` (the admin bearer token; unset: no auth, loopback only),
``DMUON_PROTECT_READS`` (reads need the token too), ``DMUON_DATABASE_URL``
(``sqlite:///path`` or ``postgresql://user@host/db``) or ``DMUON_DB`` (a SQLite path),
``DMUON_STORAGE`` (job directories), ``DMUON_DATA_ROOT`` (where ``data.source`` files
live; default ``<storage>/data``), ``RAY_ADDRESS`` (unset: a local head, or with
``DMUON_LOCAL_RAY=0`` only a queue), ``DMUON_LOCAL_CPUS``, ``DMUON_KEEP_RAY`` (the
local head outlives the service's shutdown), ``DMUON_MAX_RUNNING``,
``DMUON_SERVICE_URL`` (where jobs post metrics), ``DMUON_ALLOWED_HOSTS`` (extra Host
names accepted without a token).
"""

from __future__ import annotations

import os

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DMUON_", extra="ignore")

    api_token: SecretStr | None = None
    protect_reads: bool = False
    db: str = "dmuon.db"
    database_url: str | None = None
    storage: str = "dmuon_runs"
    data_root: str | None = None
    ray_address: str | None = Field(None, validation_alias=AliasChoices("RAY_ADDRESS"))
    local_ray: bool = True
    local_cpus: int = Field(4, ge=1, le=4096)
    keep_ray: bool = False  # the local head (and its running jobs) outlives a shutdown
    max_running: int = Field(1, ge=1, le=10_000)
    service_url: str = "http://127.0.0.1:8000"
    allowed_hosts: str = ""
    # planning builds the model on the meta device: CPU-bound, so a few at a time
    max_concurrent_plans: int = Field(2, ge=1, le=64)

    @field_validator("api_token")
    @classmethod
    def _not_blank(cls, v: SecretStr | None):
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("DMUON_API_TOKEN is set but empty: unset it (no auth, "
                             "loopback only) or give it a value")
        return v

    @field_validator("ray_address", "database_url", "data_root")
    @classmethod
    def _empty_is_unset(cls, v: str | None):
        return v or None

    @field_validator("storage")
    @classmethod
    def _absolute(cls, v: str) -> str:
        return os.path.abspath(v)

    def token(self) -> str | None:
        return self.api_token.get_secret_value() if self.api_token else None

    def store_url(self) -> str:
        """A SQLAlchemy URL: ``postgresql://`` gets the psycopg (v3) driver; ``DMUON_DB``
        is a SQLite file."""
        url = self.database_url or f"sqlite:///{os.path.abspath(self.db)}"
        scheme, sep, rest = url.partition("://")
        if scheme in ("postgresql", "postgres"):
            return f"postgresql+psycopg://{rest}"
        if scheme in ("sqlite", "postgresql+psycopg") and sep and rest:
            return url
        raise ValueError(f"DMUON_DATABASE_URL={url!r}: use sqlite:///<path> or "
                         "postgresql://<user>@<host>/<database>")

    def data_dir(self) -> str:
        return os.path.abspath(self.data_root or os.path.join(self.storage, "data"))

    def hosts(self) -> set[str]:
        return {*LOOPBACK_HOSTS, *(h.strip() for h in self.allowed_hosts.split(",") if h)}
