"""A real uvicorn serving the control plane on 127.0.0.1, and a small client (requests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import requests

from helpers.paths import ROOT
from service.control.ray_head import STATE_FILE, free_port, pids_with, stop_recorded
from service.control.serve import wait_healthy


def strict_json(text: str):
    """JSON as the standard defines it: NaN or Infinity is an error, as in a browser."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


class Service:
    """``dmuon-serve`` in its own session; ``argv`` replaces the command (a wrapper)."""

    def __init__(self, root: str, token: str | None = "secret-token", argv=None, **env):
        self.port, self.token, self.root = free_port(), token, root
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "DMUON_DB": os.path.join(root, "dmuon.db"),
                    "DMUON_STORAGE": os.path.join(root, "runs"),
                    "DMUON_SERVICE_URL": self.url, **env}
        self.env.pop("DMUON_API_TOKEN", None)
        if token is not None:
            self.env["DMUON_API_TOKEN"] = token
        self.argv = argv or [sys.executable, "-m", "service.control.serve"]
        self.session = requests.Session()
        self.proc = None
        self.start()

    def start(self, *flags: str, stderr: str | None = None) -> None:
        """``flags`` go to dmuon-serve; ``stderr``: a file for its standard error."""
        err = open(stderr, "ab") if stderr else None
        try:
            self.proc = subprocess.Popen(
                [*self.argv, "--host", "127.0.0.1", "--port", str(self.port), "--log-level",
                 "warning", *flags], env=self.env, start_new_session=True, cwd=ROOT,
                stderr=err)
        finally:
            if err is not None:
                err.close()
        wait_healthy(self.url, self.proc, timeout_s=120)

    def head(self) -> dict:
        """The local Ray head the service records (``ray_head.json``)."""
        with open(os.path.join(self.env["DMUON_STORAGE"], STATE_FILE)) as fh:
            return json.load(fh)

    def signalled(self, sig, timeout: float = 60) -> int:
        """Send ``sig`` to dmuon-serve alone (not its session) and wait: its exit status."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    @contextlib.contextmanager
    def serving(self):
        """Yields the service; afterwards kills it and the Ray head it started."""
        try:
            yield self
        finally:
            self.kill()
            stop_recorded(self.env["DMUON_STORAGE"])

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=30)

    def events(self, job_id: str, timeout_s: float = 300, headers=None) -> list[dict]:
        """The job's SSE data (parsed as strict JSON) until the stream ends with the job;
        keep-alives would keep a socket timeout from firing, so the read has a deadline."""
        deadline, events = time.monotonic() + timeout_s, []
        with self.session.get(f"{self.url}/v1/jobs/{job_id}/events", stream=True,
                              timeout=timeout_s, headers=headers) as resp:
            assert resp.status_code == 200, resp.text
            for line in resp.iter_lines(decode_unicode=True):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{job_id}'s events still open after {timeout_s} s")
                if line.startswith("data: "):
                    events.append(strict_json(line[6:]))
        return events

    def wait_ended(self, job_id: str, timeout: float = 300) -> dict:
        """The job once it is SUCCEEDED, FAILED or STOPPED."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            job = self.request("GET", f"/v1/jobs/{job_id}")[1]
            if job["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                return job
            time.sleep(0.5)
        raise TimeoutError(f"{job_id} still {job['status']}")

    def request(self, method, path, body=None, *, token=True, headers=None, timeout=30,
                data=None):
        """(status, parsed JSON or text). ``data``: raw bytes instead of a JSON body."""
        headers = {"Content-Type": "application/json", **(headers or {})}
        if token is True and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        elif isinstance(token, str):
            headers["Authorization"] = f"Bearer {token}"
        if data is None and body is not None:
            data = json.dumps(body).encode()
        resp = self.session.request(method, self.url + path, data=data, headers=headers,
                                    timeout=timeout)
        try:
            return resp.status_code, strict_json(resp.text)
        except ValueError:
            return resp.status_code, resp.text


def head_processes(head: dict) -> set[int]:
    """Every process of a local Ray head: its session's (``ray start`` leads it) and
    every one whose command line names its private temp dir."""
    found = set(pids_with(head["temp_dir"]))
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == head["pid"]:  # the session id
            found.add(int(pid))
    return found


def alive(pids) -> set[int]:
    """Those still running (a zombie has ended: it only waits for its parent)."""
    from service.control.ray_head import _alive

    return {p for p in pids if _alive(p)}
