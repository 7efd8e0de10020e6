"""``dmuon.testing.run``: ranks forked from a preloaded server see what spawned ranks saw."""

from __future__ import annotations

import os
import sys

from dmuon.testing import probe_point, run


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


def test_every_probe_point_names_a_method_the_core_has():
    """The benchmarks wrap these by name (``bench/overlap.py``, ``bench/_setups.py``): a
    point left behind by a move (the waits went to ``BoundaryTransfer``, NS batching to
    ``ns_schedule``) breaks them at import, which no test of the core would see."""
    from dmuon import boundary_transfer, comm, ns_schedule, reduce

    expected = {"wait_gather": boundary_transfer.BoundaryTransfer,
                "wait_replicate": boundary_transfer.BoundaryTransfer,
                "land": reduce.GradientReduce, "side_stream": comm.Streams,
                "optimizer_ns": ns_schedule}
    for name, owner in expected.items():
        where, attr = probe_point(name)
        assert where is owner and callable(getattr(where, attr)), name


def test_the_benchmarks_setups_import():
    """``bench/_setups.py`` resolves its probe at import: every CPU benchmark imports it."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "_setups.py")
    spec = importlib.util.spec_from_file_location("_bench_setups", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.dirname(path))
        del sys.modules[spec.name]
    assert callable(module.shared_cores)
