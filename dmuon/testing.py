"""Run a function on N gloo processes on this machine's loopback, for tests and benchmarks.

Clusters go through Ray (``service.worker``); this is the no-Ray way to exercise the core.
Not imported by ``import dmuon``: use ``from dmuon.testing import run``.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT = timedelta(seconds=60)  # a bug fails fast instead of hanging
# Ranks fork from a server that has imported these once (a spawned rank spends about 3 s
# of a 2-core machine importing torch); a forked rank gets the caller's environment,
# working directory and sys.path as a spawned one would.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "dmuon"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, env, port, out_dir, fn, args, kwargs):
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
    result = fn(rank, world_size, *args, **kwargs)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    leave_process_group()


def leave_process_group() -> None:
    """End a finished rank without gloo's teardown.

    Now and then (seen here about once in ten 4-rank runs, demo and tests alike) the
    process aborts after its work is done, in the C++ teardown of gloo's threads
    ("terminate called without an active exception"). The barrier makes sure no peer
    still needs this rank; the sockets then close with the process, and the C++
    destructors that abort are skipped.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(fn, *args, world_size: int = 4, **kwargs) -> list:
    """``fn(rank, world_size, *args, **kwargs)`` on every rank; returns per-rank results."""
    mp.set_forkserver_preload(PRELOAD)  # read when the server starts, once per process
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker, args=(world_size, dict(os.environ), free_port(), out_dir, fn, args, kwargs),
            nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def probe_point(name: str) -> tuple[object, str]:
    """``(owner, attribute)`` of one place in the core a benchmark may wrap to time or
    perturb it, so production code carries no clock and benchmarks import public modules
    only: ``wait_gather``, ``wait_replicate`` (a boundary's waits for its all-gathers),
    ``land`` (the owner's wait for a reduced gradient), ``side_stream`` (the context
    every side-stream block runs in) and ``optimizer_ns`` (the NS ``dmuon.Muon`` calls)."""
    from . import comm, ns_schedule
    from .boundary_transfer import BoundaryTransfer
    from .reduce import GradientReduce

    points = {"wait_gather": (BoundaryTransfer, "wait_gather"),
              "wait_replicate": (BoundaryTransfer, "wait_replicate"),
              "land": (GradientReduce, "land"), "side_stream": (comm.Streams, "issuing"),
              "optimizer_ns": (ns_schedule, "newton_schulz")}
    if name not in points:
        raise ValueError(f"no probe point {name!r}; there are {sorted(points)}")
    return points[name]
