"""``make demo``: the control plane with its local Ray head, and the default job on it.

Starts ``dmuon-serve`` on 127.0.0.1 (which starts a Ray head on 127.0.0.1), submits the
default job (the built-in model on 4 CPU workers, HSDP 2 x 2) over REST, logs the
dashboard URL and follows the job as ``dmuon-svc submit --follow`` does (its start-up
phases, then a tqdm bar of steps; messages on stderr). It then keeps serving until
Ctrl-C; with ``DEMO_EXIT_ON_FINISH=1`` it exits when the job ends (0 if it succeeded).
On exit it stops the service and the Ray head it started, by PID.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from ..control.cli import commands as cli
from ..control.cli.output import setup_logging
from ..control.ray_head import free_port, stop_recorded
from ..control.serve import wait_healthy

log = logging.getLogger("service.dev.demo")

DEFAULT_JOB = {"name": "demo", "model": "small", "steps": 40, "batch_size": 4,
               "seq_len": 64, "layout": {"replicate": 2, "shard": 2},
               "data": {"val_every": 10}, "checkpoint": {"interval": 20},
               "optimizer": {"adamw_lr": 3e-3}}


def _port(wanted: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", wanted))
            return wanted
        except OSError:
            return free_port()


def _print_latency(records: list[dict]) -> None:
    """From a rank's step record to the service's store: the control plane's promise is
    under 2 s."""
    lag = sorted(r["received"] - r["time"] for r in records if "received" in r)
    if lag:
        log.info("metrics latency over %d records: p50 %.2f s, max %.2f s", len(lag),
                 lag[len(lag) // 2], lag[-1])


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    setup_logging(names=("service.control.cli", "service.dev.demo"))
    signal.signal(signal.SIGTERM, _interrupt)  # clean up as on Ctrl-C
    root = os.path.abspath(os.environ.get("DEMO_DIR", "demo_runs"))
    port = _port(int(os.environ.get("DEMO_PORT", "8000")))
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DMUON_STORAGE": root, "DMUON_DB": os.path.join(root, "dmuon.db"),
           "DMUON_API_TOKEN": os.environ.get("DMUON_API_TOKEN") or secrets.token_urlsafe(16),
           "DMUON_LOCAL_CPUS": "4", "DMUON_PORT": str(port), "DMUON_HOST": "127.0.0.1",
           "DMUON_SERVICE_URL": url, "DMUON_LOG_LEVEL": "warning"}
    env.pop("RAY_ADDRESS", None)
    os.makedirs(root, exist_ok=True)
    os.environ.update(DMUON_URL=url, DMUON_API_TOKEN=env["DMUON_API_TOKEN"])
    log.info("starting the control plane and a local Ray head (storage %s) ...", root)
    service = subprocess.Popen([sys.executable, "-m", "service.control.serve"], env=env,
                               start_new_session=True)
    try:
        wait_healthy(url, service)
        job = cli.request("POST", "/v1/jobs", {"spec": DEFAULT_JOB})
        log.info("submitted %s: %s model, HSDP 2 x 2 on 4 CPU workers, %d steps", job["id"],
                 DEFAULT_JOB["model"], DEFAULT_JOB["steps"])
        log.info("dashboard: %s/#job=%s   (API token %s)", url, job["id"],
                 env["DMUON_API_TOKEN"])
        status = cli.follow(job["id"], DEFAULT_JOB["steps"])
        _print_latency(cli.request("GET", f"/v1/jobs/{job['id']}/metrics"))
        if status != "SUCCEEDED":
            log.error("the job's output (its end):\n%s",
                      cli.request("GET", f"/v1/jobs/{job['id']}/logs")[-4000:])
        if os.environ.get("DEMO_EXIT_ON_FINISH") == "1":
            return 0 if status == "SUCCEEDED" else 1
        log.info("the dashboard stays at %s; Ctrl-C stops the service and Ray", url)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        os.killpg(service.pid, signal.SIGTERM)
        try:
            service.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(service.pid, signal.SIGKILL)
        stop_recorded(root)
        log.info("stopped the service and its Ray head")


if __name__ == "__main__":
    sys.exit(main())
