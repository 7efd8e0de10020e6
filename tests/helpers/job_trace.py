"""One submission traced in a fresh process (``tests/helpers/job_path.py``): the files
of ``service/`` and ``dmuon/`` it reaches and the counts it keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers.paths import ROOT


def traced(out) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DMUON_") and k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "helpers", "job_path.py"),
                           str(out)], cwd=out, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(os.path.join(out, "trace.json")) as fh:
        return json.load(fh)
