"""``dmuon.testing.run``: ranks forked from a preloaded server see what spawned ranks saw."""

from __future__ import annotations

import os

from dmuon.testing import run


def _seen(rank, world):
    return os.environ.get("DMUON_LOCAL_PROBE"), os.getcwd(), os.environ["MASTER_ADDR"]


def test_ranks_get_the_callers_environment_and_directory(tmp_path, monkeypatch):
    """The forkserver starts once per process, with the environment of that moment; each
    run hands its ranks the caller's current one, as spawn would."""
    run(_seen, world_size=2)  # the server exists before the change below
    monkeypatch.setenv("DMUON_LOCAL_PROBE", "after the server started")
    monkeypatch.chdir(tmp_path)
    seen = run(_seen, world_size=2)
    assert seen == [("after the server started", str(tmp_path), "127.0.0.1")] * 2
