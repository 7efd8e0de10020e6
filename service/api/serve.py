"""Start the control plane under uvicorn: ``dmuon-serve`` (or ``python -m service.serve``).

Binds ``DMUON_HOST``:``DMUON_PORT`` (default 127.0.0.1:8000; a container sets
``DMUON_HOST=0.0.0.0``). Every other setting is read by ``service.app.Settings``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request

DEFAULT_PORT = 8000


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Until ``url``/healthz answers; a service with a local Ray head starts it first.
    Fails at once if ``proc`` (the service) exits."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(f"{url}/healthz", timeout=2).read()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the service at {url} did not answer /healthz in {timeout_s:.0f} s")


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
    import uvicorn

    uvicorn.run("service.app:create_app", factory=True, host=args.host, port=args.port,
                log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
