"""Start the control plane under uvicorn: ``dmuon-serve`` (or ``python -m service.control.serve``).

Binds ``DMUON_HOST``:``DMUON_PORT`` (default 127.0.0.1:8000; a container sets
``DMUON_HOST=0.0.0.0``). Every other setting is read by ``service.control.settings``. The
settings and the job store are checked before the server starts, so a bad token, URL or
database file ends the command with the reason, not a traceback.

Ctrl-C or SIGTERM shuts the service down (exit status 0) and stops the local Ray head it
ran on, unless ``--keep-ray`` (``DMUON_KEEP_RAY=1``) keeps it, and its running jobs, for
the next ``dmuon-serve``, which re-attaches; ``dmuon-serve --stop-ray`` stops the head
recorded under ``DMUON_STORAGE``, by PID.
"""

from __future__ import annotations

import argparse
import os
import signal
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


def _arguments(argv):
    ap = argparse.ArgumentParser(prog="dmuon-serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default=os.environ.get("DMUON_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("DMUON_PORT",
                                                                   DEFAULT_PORT)))
    ap.add_argument("--log-level", default=os.environ.get("DMUON_LOG_LEVEL", "info"))
    ap.add_argument("--keep-ray", action="store_true",
                    help="on Ctrl-C or SIGTERM leave the local Ray head (and its running "
                         "jobs) for the next dmuon-serve to re-attach to (DMUON_KEEP_RAY=1)")
    ap.add_argument("--stop-ray", action="store_true",
                    help="stop the local Ray head recorded under DMUON_STORAGE, by PID, "
                         "and exit (no server)")
    return ap.parse_args(argv)


def stop_ray() -> int:
    """``--stop-ray``: the recorded head's processes end; others' Ray is left alone."""
    from .ray_head import STATE_FILE, stop_recorded
    from .settings import Settings

    storage = Settings().storage
    head = stop_recorded(storage)
    if head is None:
        print(f"dmuon-serve: no local Ray head recorded in {storage}/{STATE_FILE}",
              file=sys.stderr)
        return 1
    print(f"stopped the local Ray head (pid {head.pid}, {head.temp_dir})")
    return 0


def main(argv=None) -> int:
    args = _arguments(argv)
    if args.stop_ray:
        return stop_ray()
    if args.keep_ray:
        os.environ["DMUON_KEEP_RAY"] = "1"
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
    config = uvicorn.Config("service.control.app:create_app", factory=True, host=args.host,
                            port=args.port, log_level=args.log_level,
                            # open event streams end after 5 s, so the shutdown (and the
                            # local head's stop) does not wait on their clients
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    return 0 if _run_until_signalled(server, sock) or server.started else 1


def _run_until_signalled(server, sock) -> bool:
    """Serve until Ctrl-C or SIGTERM; whether one came. uvicorn shuts down gracefully on
    either, then raises it again for the handler it found: ours only notes it, so the
    exit is quiet (no KeyboardInterrupt traceback, no death by SIGTERM)."""
    caught = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return bool(caught)


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
