"""Start the control plane under uvicorn: ``dmuon-serve`` (or ``python -m service.api.serve``).

Binds ``DMUON_HOST``:``DMUON_PORT`` (default 127.0.0.1:8000; a container sets
``DMUON_HOST=0.0.0.0``). Every other setting is read by ``service.api.settings``. The
settings and the job store are checked before the server starts, so a bad token, URL or
database file ends the command with the reason, not a traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import requests

DEFAULT_PORT = 8000
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Until ``url``/healthz answers; a service with a local Ray head starts it first.
    Fails at once if ``proc`` (the service) exits."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with code {proc.returncode}")
        try:
            requests.get(f"{url}/healthz", timeout=2).raise_for_status()
            return
        except requests.RequestException:
            time.sleep(0.2)
    raise TimeoutError(f"the service at {url} did not answer /healthz in {timeout_s:.0f} s")


def preflight(host: str) -> str | None:
    """Why the service must not start (None: it may)."""
    from pydantic import ValidationError

    from .settings import Settings
    from .store import JobStore, StoreError

    try:
        settings = Settings()
        url = settings.store_url()
    except (ValidationError, ValueError) as e:
        return str(e)
    if settings.token() is None and host not in LOOPBACK and \
            os.environ.get("DMUON_ALLOW_NO_TOKEN") != "1":
        return (f"DMUON_API_TOKEN is unset and the service would listen on {host}: set a "
                "token (or DMUON_ALLOW_NO_TOKEN=1 behind a proxy that authenticates)")
    try:
        JobStore(url).close()
    except StoreError as e:
        return str(e)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dmuon-serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default=os.environ.get("DMUON_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("DMUON_PORT",
                                                                   DEFAULT_PORT)))
    ap.add_argument("--log-level", default=os.environ.get("DMUON_LOG_LEVEL", "info"))
    args = ap.parse_args(argv)
    # jobs post their metrics here unless the deployment names another address
    reachable = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    os.environ.setdefault("DMUON_SERVICE_URL", f"http://{reachable}:{args.port}")
    refused = preflight(args.host)
    if refused:
        print(f"dmuon-serve: {refused}", file=sys.stderr)
        return 2
    import uvicorn

    # bound before the app starts its local Ray head, whose processes take ports of
    # their own: the chosen port is then this service's, whatever Ray picks
    sock = _bound_socket(args.host, args.port)
    config = uvicorn.Config("service.api.app:create_app", factory=True, host=args.host,
                            port=args.port, log_level=args.log_level)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _bound_socket(host: str, port: int):
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"dmuon-serve: cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    sys.exit(main())
