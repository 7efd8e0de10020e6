"""A PostgreSQL server of the test's own: Debian's PostgreSQL 15 in a temp dir, run as
the ``postgres`` user (it refuses root), on 127.0.0.1 and a free port; stopped by
``pg_ctl stop`` (never by name)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid

from service.control.ray_head import free_port

BIN = "/usr/lib/postgresql/15/bin"


def available() -> str | None:
    """None when a server can be started here, else why not."""
    if not os.path.exists(f"{BIN}/initdb"):
        return f"PostgreSQL 15 is not installed ({BIN}/initdb): apt-get install postgresql"
    if os.geteuid() != 0:
        return "starting PostgreSQL as the postgres user needs root"
    return None


def _as_postgres(*argv: str, timeout: float = 60) -> None:
    subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True,
                   capture_output=True, text=True, timeout=timeout)


class Postgres:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="dmuon-pg-")
        shutil.chown(self.dir, "postgres", "postgres")
        self.data, self.port = os.path.join(self.dir, "data"), free_port()
        _as_postgres(f"{BIN}/initdb", "-D", self.data, "-A", "trust", "-U", "postgres",
                     "--no-sync", timeout=120)
        _as_postgres(f"{BIN}/pg_ctl", "-D", self.data, "-l", os.path.join(self.dir, "log"),
                     "-w", "-o", f"-k {self.dir} -p {self.port} -h 127.0.0.1 "
                                 "-c fsync=off -c max_connections=300", "start")

    def database(self) -> str:
        """A new, empty database; its URL as DMUON_DATABASE_URL takes it."""
        name = f"t{uuid.uuid4().hex[:10]}"
        _as_postgres(f"{BIN}/createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U",
                     "postgres", name)
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        _as_postgres(f"{BIN}/pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)
