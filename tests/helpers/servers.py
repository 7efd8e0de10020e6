"""A server process a test starts (its own session) and stops by its process group."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import requests


class Server:
    """``argv`` started at once; ``wait()`` until ``url + ready`` answers 200."""

    def __init__(self, argv: list[str], url: str, ready: str, env: dict | None = None,
                 log: str | None = None):
        self.url, self.ready = url, ready
        self.log = open(log or os.devnull, "ab")
        self.proc = subprocess.Popen(argv, env={**os.environ, **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self, timeout_s: float = 120) -> Server:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert self.proc.poll() is None, f"{self.proc.args[:3]} exited: see {self.log.name}"
            try:
                if requests.get(self.url + self.ready, timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.url}{self.ready} did not answer in {timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM to the process group this server leads (its workers, TensorBoard's
        data server), SIGKILL after 20 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self.log.close()

    def __enter__(self) -> Server:
        return self.wait()

    def __exit__(self, *exc) -> None:
        self.stop()
