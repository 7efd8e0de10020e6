"""TensorBoard's own reading of a job's event files: the ``tensorboard`` package's event
file loader (it checks every record's CRC32C), and a real ``tensorboard --logdir``
process read through its HTTP API, as a person's browser reads it."""

from __future__ import annotations

import glob
import os
import sys
import time

import requests

from helpers.servers import Server
from service.control.ray_head import free_port


def event_files(log_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*")))


def scalars(log_dir: str) -> dict[str, list[tuple[int, float, float]]]:
    """{tag: [(step, value, wall_time), ...]} in file order, over every event file."""
    from tensorboard.backend.event_processing.event_file_loader import (
        LegacyEventFileLoader,
    )

    out: dict[str, list[tuple[int, float, float]]] = {}
    for path in event_files(log_dir):
        for event in LegacyEventFileLoader(path).Load():
            for value in event.summary.value:
                out.setdefault(value.tag, []).append(
                    (event.step, value.simple_value, event.wall_time))
    return out


class TensorBoard(Server):
    """``tensorboard --logdir LOGDIR`` (the command the docs give), the console script
    the package installs next to this interpreter."""

    def __init__(self, logdir: str):
        port = free_port()
        command = os.path.join(os.path.dirname(sys.executable), "tensorboard")
        super().__init__([command, "--logdir", logdir, "--host", "127.0.0.1", "--port",
                          str(port)], f"http://127.0.0.1:{port}", "/data/runs")

    def scalars(self, run: str, tag: str, steps: int, timeout_s: float = 60) -> list:
        """[(step, value)] of ``tag`` in ``run`` from the scalars plugin's HTTP API, once
        it lists ``steps`` points (TensorBoard loads event files in the background)."""
        deadline = time.time() + timeout_s
        while True:
            resp = requests.get(f"{self.url}/data/plugin/scalars/scalars",
                                params={"run": run, "tag": tag}, timeout=10)
            points = resp.json() if resp.status_code == 200 else []
            if len(points) >= steps or time.time() > deadline:
                return [(step, value) for _, step, value in points]
            time.sleep(0.5)
