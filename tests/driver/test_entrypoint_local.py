"""The README's "without the control plane" command, as written, on its own job.yaml:
``python -m service.driver.job_driver --spec job.yaml`` starts a local Ray and runs the
2 x 2 job to SUCCEEDED on this 2-core machine (issue 34, item 1: it used to start Ray
with the machine's 2 CPUs and refuse the 4 workers). The CPUs it gives a local Ray, on
a 2-CPU machine whatever this one has: ``--num-cpus``, else ``DMUON_LOCAL_CPUS``, else
the machine's or the spec's, whichever is more."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml
from helpers import paths

from service.control.ray_head import LocalRayHead
from service.driver.job_driver import local_cpus
from service.job.spec import parse_spec

ROOT = pathlib.Path(paths.ROOT)
README = (ROOT / "README.md").read_text()


def _readme_job() -> str:
    return re.search(r"^```yaml\n(# job\.yaml\n.*?)^```", README, re.S | re.M).group(1)


def _readme_command() -> list[str]:
    line = re.search(r"^ {4}(python -m service\.driver\.job_driver --spec job\.yaml)\s+#",
                     README, re.M).group(1)
    return [sys.executable, *shlex.split(line)[1:]]


@pytest.mark.parametrize("layout,env,given,want", [
    ({"replicate": 2, "shard": 2}, None, None, 4),  # the README's job on 2 cores
    ({"replicate": 2, "shard": 1, "tp": 2}, None, None, 4),  # R x N x T workers
    ({"replicate": 1, "shard": 1}, None, None, 2),  # never fewer than the machine's
    ({"nodes": 1, "workers_per_node": 3}, None, None, 3),
    ({}, None, None, 2),  # auto: the planner sizes the job to what Ray has
    ({"replicate": 2, "shard": 2}, "6", None, 6),  # as the control plane's local head
    ({"replicate": 2, "shard": 2}, "6", 3, 3),  # --num-cpus
])
def test_the_local_rays_cpus(monkeypatch, layout, env, given, want):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    if env is None:
        monkeypatch.delenv("DMUON_LOCAL_CPUS", raising=False)
    else:
        monkeypatch.setenv("DMUON_LOCAL_CPUS", env)
    assert local_cpus(parse_spec({"model": "tiny", "layout": layout}), given) == want


def test_half_cpu_workers_need_half_the_cpus(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.delenv("DMUON_LOCAL_CPUS", raising=False)
    spec = parse_spec({"model": "tiny", "layout": {"replicate": 2, "shard": 3},
                       "resources_per_worker": {"CPU": 0.5}})
    assert local_cpus(spec) == 3


def test_the_readme_command_runs_its_job_yaml_to_success(tmp_path):
    """... and, with a second Ray instance on the machine (a service's head), its
    redirected output is what the job said: no colour codes, no Ray traceback from a
    neighbour's instance, no error line from Ray Train's own actors (issue 43, 4 and 6)."""
    (tmp_path / "job.yaml").write_text(_readme_job())
    spec = yaml.safe_load(_readme_job())
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "DMUON_LOCAL_CPUS", "DMUON_STORAGE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    # the driver's temp dir: short (Ray's socket paths), the test's own
    env["TMPDIR"] = scratch = tempfile.mkdtemp(prefix="d-", dir="/tmp")
    neighbour = LocalRayHead.start(num_cpus=1)
    try:
        proc = subprocess.run(_readme_command(), cwd=tmp_path, env=env, capture_output=True,
                              timeout=400)
        # the Ray it started itself is gone with its session (no ray/session_*) and
        # its dashboard's pymp-* dir; torch's compile cache stays, as a cache does
        left = sorted(n for n in os.listdir(scratch) if not n.startswith("torchinductor_"))
    finally:
        neighbour.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    assert not os.path.exists(neighbour.temp_dir)  # a stopped head leaves no temp dir
    assert left == [], left
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert b"\x1b" not in proc.stdout + proc.stderr, (out + err)[-3000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
    assert "multiple active Ray instances" not in out + err, (out + err)[-3000:]
    assert not re.search(r" E \d+ \d+\]|max_restarts > 0", out + err), err
    summary = json.loads(next(line for line in reversed(out.splitlines())
                              if line.startswith('{"summary": ')))["summary"]
    assert (summary["status"], summary["layout"], summary["final_step"]) == (
        "SUCCEEDED", [2, 2], spec["steps"])
    steps = [int(m[1]) for m in re.finditer(r"step (\d+)  loss \S+ \(mean of 4 ranks\)", out)]
    assert steps == list(range(1, spec["steps"] + 1)), out[-3000:]
    job_dir = tmp_path / "dmuon_runs" / summary["job_id"]  # the default storage, ./dmuon_runs
    assert (job_dir / "export" / "config.json").is_file()
    checkpoints = sorted(p.name for p in (job_dir / "dcp").iterdir())
    assert checkpoints == ["step_000010", "step_000020"]  # interval 10, keep_last 2
