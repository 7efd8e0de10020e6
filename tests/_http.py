"""A real uvicorn serving the control plane on 127.0.0.1, and a tiny stdlib client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from service.local_ray import free_port
from service.serve import wait_healthy


class Service:
    def __init__(self, root: str, token: str = "secret-token", **env):
        self.port, self.token = free_port(), token
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "DMUON_API_TOKEN": token,
                    "DMUON_DB": os.path.join(root, "dmuon.db"),
                    "DMUON_STORAGE": os.path.join(root, "runs"),
                    "DMUON_SERVICE_URL": self.url, **env}
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.serve", "--host", "127.0.0.1", "--port",
             str(self.port), "--log-level", "warning"],
            env=self.env, start_new_session=True)
        wait_healthy(self.url, self.proc, timeout_s=120)

    def kill(self, sig=signal.SIGKILL) -> None:
        os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=30)

    def events(self, job_id: str, timeout_s: float = 300) -> list[dict]:
        """The job's SSE data until the stream ends with the job; keep-alives would keep
        a socket timeout from ever firing, so the whole read has a deadline."""
        deadline, events = time.monotonic() + timeout_s, []
        with urllib.request.urlopen(f"{self.url}/v1/jobs/{job_id}/events",
                                    timeout=timeout_s) as resp:
            for raw in resp:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{job_id}'s events still open after {timeout_s} s")
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        return events

    def request(self, method, path, body=None, *, token=True, headers=None, timeout=30):
        """(status, parsed JSON or text)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {self.token}")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()
