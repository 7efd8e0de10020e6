"""The whole suite's environment: loopback gloo, one thread per process, Ray without usage
stats or auth. The tests' shared code is the ``helpers`` package (pyproject's pytest
``pythonpath`` puts the checkout and tests/ first)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# Ray reads this when imported: local clusters keep 127.0.0.1 as their node address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray Train's controller takes a worker's report when it polls (Ray's default every 2 s,
# the entrypoint's 0.5 s) and the worker waits for that at its next report: tiny test
# steps take 0.2 s, so at 0.5 s a job's steps would wait on the poll, not compute
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def postgres():
    """One PostgreSQL server for the session (about 2 s to start); each user makes its
    own database. Fails (not skips) where it cannot start: CI runs as root with the
    Debian package installed."""
    from helpers.postgres import Postgres, available

    reason = available()
    if reason:
        pytest.fail(reason)
    server = Postgres()
    yield server
    server.stop()
