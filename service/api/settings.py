"""The control plane's settings, read from the environment when the app is made."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class Settings:
    api_token: str | None = field(default_factory=lambda: os.environ.get("DMUON_API_TOKEN"))
    db_path: str = field(default_factory=lambda: os.environ.get("DMUON_DB", "dmuon.db"))
    # SQLAlchemy-style URL; overrides db_path. Only SQLite is implemented so far.
    database_url: str | None = field(
        default_factory=lambda: os.environ.get("DMUON_DATABASE_URL") or None)
    storage: str = field(default_factory=lambda: os.path.abspath(
        os.environ.get("DMUON_STORAGE", "dmuon_runs")))
    protect_reads: bool = field(default_factory=lambda: _flag("DMUON_PROTECT_READS", False))
    ray_address: str | None = field(
        default_factory=lambda: os.environ.get("RAY_ADDRESS") or None)
    local_ray: bool = field(default_factory=lambda: _flag("DMUON_LOCAL_RAY", True))
    max_running: int = field(default_factory=lambda: int(os.environ.get("DMUON_MAX_RUNNING",
                                                                        "1")))
    service_url: str = field(default_factory=lambda: os.environ.get(
        "DMUON_SERVICE_URL", "http://127.0.0.1:8000"))
    # the local head's CPUs, and the inventory a plan assumes when no cluster is attached
    local_cpus: int = field(default_factory=lambda: int(os.environ.get("DMUON_LOCAL_CPUS",
                                                                       "4")))

    def sqlite_path(self) -> str:
        """The store's file: ``database_url`` (``sqlite:///relative.db`` or
        ``sqlite:////absolute.db``) if set, else ``db_path``."""
        if not self.database_url:
            return self.db_path
        scheme, sep, rest = self.database_url.partition("://")
        if scheme != "sqlite" or not sep or not rest.startswith("/") or rest == "/":
            raise ValueError(f"DMUON_DATABASE_URL={self.database_url!r}: the job store "
                             "supports SQLite only, as sqlite:///<path>")
        return rest[1:]


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")
