"""Control-plane read latency: GET /v1/jobs/{id} under 100 concurrent readers.

Side by side in one run, with the same client: this tree on SQLite, this tree on
PostgreSQL (a server of its own, as the tests start one), and the baseline commit
(d92165d, before issue #15) on SQLite, checked out with ``git worktree`` into a temp dir
and served with the same venv. Each service gets one dry-run job, then 100 keep-alive
connections read it for a bounded time with ``wrk`` (Debian's package; a C client, so
the load generator does not take the CPU the service under test needs on a 2-core
machine, as a Python client does). Prints a table and writes bench/results/api.json.

    python -m bench.api [--skip-baseline] [--skip-postgres]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import requests

from service.control.ray_head import free_port
from service.control.serve import wait_healthy

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
READERS, SECONDS = 100, 10
BASELINE = "d92165d"
TOKEN = "bench-token"


def _serve(source: pathlib.Path, module: str, env: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port",
                             str(port), "--log-level", "warning"],
                            env={**os.environ, **env, "PYTHONPATH": str(source),
                                 "DMUON_API_TOKEN": TOKEN, "DMUON_LOCAL_RAY": "0"},
                            cwd=source, start_new_session=True)
    wait_healthy(url, proc, timeout_s=120)
    return proc, url


def _wrk(url: str, job_id: str, seconds: int) -> dict:
    """``wrk`` with READERS connections for ``seconds``: requests/s and latency
    percentiles (its ``--latency`` distribution), refusing any non-2xx answer."""
    out = subprocess.run(
        ["wrk", "-t", "2", "-c", str(READERS), "-d", f"{seconds}s", "--latency",
         "-H", f"Authorization: Bearer {TOKEN}", f"{url}/v1/jobs/{job_id}"],
        check=True, capture_output=True, text=True, timeout=seconds + 60).stdout
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw error answers:\n{out}")
    unit = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    pct = {int(q): float(v) * unit[u] for q, v, u in
           re.findall(r"^\s+(50|90|99)%\s+([\d.]+)(us|ms|s)$", out, re.M)}
    return {"requests": int(re.search(r"(\d+) requests in", out).group(1)),
            "requests_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": pct[50], "p90_ms": pct[90], "p99_ms": pct[99]}


def measure(name: str, source: pathlib.Path, module: str, env: dict) -> dict:
    proc, url = _serve(source, module, env)
    try:
        job = requests.post(f"{url}/v1/jobs", json={"spec": {"model": "tiny"},
                                                    "dry_run": True},
                            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120).json()
        _wrk(url, job["id"], 3)  # warm-up: connection pools, caches, imports
        row = _wrk(url, job["id"], SECONDS)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    return {"service": name, "readers": READERS, **row}


def _baseline_tree(tmp: str) -> pathlib.Path:
    tree = pathlib.Path(tmp) / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                    BASELINE], check=True, capture_output=True)
    return tree


def _postgres_url(tmp: str):
    sys.path.insert(0, str(ROOT / "tests"))
    from _postgres import Postgres

    server = Postgres()
    return server, server.database()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--skip-postgres", action="store_true")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="dmuon-bench-api-")
    rows, server, tree = [], None, None
    try:
        rows.append(measure("this tree, SQLite", ROOT, "service.control.serve",
                            {"DMUON_DB": f"{tmp}/new.db", "DMUON_STORAGE": tmp}))
        if not args.skip_postgres:
            server, url = _postgres_url(tmp)
            rows.append(measure("this tree, PostgreSQL", ROOT, "service.control.serve",
                                {"DMUON_DATABASE_URL": url, "DMUON_STORAGE": tmp}))
        if not args.skip_baseline:
            tree = _baseline_tree(tmp)
            rows.append(measure(f"baseline {BASELINE}, SQLite", tree, "service.serve",
                                {"DMUON_DB": f"{tmp}/old.db", "DMUON_STORAGE": tmp}))
    finally:
        if server is not None:
            server.stop()
        if tree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(tree)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _report(rows)


def _report(rows: list[dict]) -> None:
    print(f"GET /v1/jobs/{{id}}, {READERS} keep-alive connections for {SECONDS} s (wrk), "
          "one uvicorn worker")
    print(f"| {'service':<26} | req/s | p50 ms | p90 ms | p99 ms |")
    print(f"|{'-' * 28}|------:|-------:|-------:|-------:|")
    for r in rows:
        print(f"| {r['service']:<26} | {r['requests_per_s']:5.0f} | {r['p50_ms']:6.1f} | "
              f"{r['p90_ms']:6.1f} | {r['p99_ms']:6.1f} |")
    base = next((r for r in rows if r["service"].startswith("baseline")), None)
    if base:
        for r in rows:
            if r is not base:
                print(f"{r['service']}: {r['requests_per_s'] / base['requests_per_s']:.2f}x "
                      f"the baseline's throughput, p99 {r['p99_ms'] / base['p99_ms']:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "api.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
