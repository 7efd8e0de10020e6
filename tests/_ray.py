"""A Ray head on loopback for tests, started as our own process group and stopped by it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayHead:
    """``ray start --head --block`` on 127.0.0.1 in a new session; ``stop()`` ends that
    session's processes (and any left with our private temp dir), never ``ray stop``."""

    def __init__(self, num_cpus: int = 4):
        self.port, self.dashboard_port = free_port(), free_port()
        self.temp_dir = tempfile.mkdtemp(prefix="dmuon-ray-")
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
             f"--port={self.port}", f"--num-cpus={num_cpus}", f"--temp-dir={self.temp_dir}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
             "--disable-usage-stats"],
            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        self._wait_ready()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _wait_ready(self, timeout: float = 90) -> None:
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2).read()
                return
            except OSError:
                time.sleep(1)
        self.stop()
        raise TimeoutError("Ray head did not come up")

    def _ours(self) -> list[int]:
        pids = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if self.temp_dir.encode() in fh.read():
                        pids.append(int(pid))
            except OSError:
                continue
        return pids

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            for pid in self._ours():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait
            while time.time() < deadline and (self.proc.poll() is None or self._ours()):
                time.sleep(0.5)
            if self.proc.poll() is not None and not self._ours():
                return
