"""Control-plane read latency: GET /v1/jobs/{id} under 100 concurrent readers.

Starts uvicorn on 127.0.0.1 with a fresh SQLite store, creates one dry-run job, then
100 threads issue 20 requests each (2,000 in all, bounded). Prints p50/p99 and writes
bench/results/api.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from service.local_ray import free_port
from service.serve import wait_healthy

RESULTS = pathlib.Path(__file__).parent / "results"
READERS, PER_READER = 100, 20


def _call(url, method="GET", body=None, token="bench"):
    req = urllib.request.Request(url, method=method,
                                 data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, json.loads(resp.read())


def main() -> None:
    port, root = free_port(), tempfile.mkdtemp(prefix="dmuon-bench-api-")
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "DMUON_API_TOKEN": "bench", "DMUON_DB": f"{root}/db.sqlite",
           "DMUON_STORAGE": root, "DMUON_LOCAL_RAY": "0"}
    server = subprocess.Popen([sys.executable, "-m", "service.serve", "--host", "127.0.0.1",
                               "--port", str(port), "--log-level", "warning"], env=env,
                              start_new_session=True)
    try:
        wait_healthy(url, server)
        _, job = _call(f"{url}/v1/jobs", "POST", {"spec": {"model": "tiny"}, "dry_run": True})

        def reader(_):
            times = []
            for _ in range(PER_READER):
                t0 = time.perf_counter()
                status, _ = _call(f"{url}/v1/jobs/{job['id']}")
                assert status == 200
                times.append(time.perf_counter() - t0)
            return times

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=READERS) as pool:
            latencies = sorted(t for ts in pool.map(reader, range(READERS)) for t in ts)
        wall = time.perf_counter() - t0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    p = {q: latencies[int(q / 100 * (len(latencies) - 1))] * 1e3 for q in (50, 90, 99)}
    out = {"requests": len(latencies), "readers": READERS, "p50_ms": p[50], "p90_ms": p[90],
           "p99_ms": p[99], "mean_ms": statistics.mean(latencies) * 1e3,
           "requests_per_s": len(latencies) / wall}
    print(f"GET /v1/jobs/{{id}}, {READERS} concurrent readers, {len(latencies)} requests: "
          f"p50 {p[50]:.1f} ms, p90 {p[90]:.1f} ms, p99 {p[99]:.1f} ms, "
          f"{out['requests_per_s']:.0f} req/s")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "api.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
