"""``bench.muon_variants`` in a tiny form: the built-in ``tiny`` model, 3 steps per run,
its record written into a temporary ``$OUT``. The figures are not checked (they are what
the bench measures); what is: the record holds exactly the runs that were asked for, each
with one step per step run, and its summary columns are read off those steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers.paths import ROOT

from bench.muon_variants import NO_CLIP, RUNS, TAU

STEPS = 3


def test_the_record_holds_the_runs_as_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "bench.muon_variants", "--preset", "tiny",
                    "--steps", str(STEPS)], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=120)
    (record,) = tmp_path.glob("muon_variants_*.json")
    data = json.loads(record.read_text())
    assert (data["preset"], data["steps"], data["tau"]) == ("tiny", STEPS, TAU)
    assert [(r["name"], r["variant"], r["lr"]) for r in data["runs"]] == \
        [(name, variant, lr) for name, variant, lr, _ in RUNS]
    for row, (_, _, _, tau) in zip(data["runs"], RUNS):
        curve = row["curve"]  # (step, loss, max logit, heads clipped, time, val loss)
        assert [s[0] for s in curve] == list(range(1, STEPS + 1))
        assert row["tau"] == (None if tau == NO_CLIP else tau)
        assert row["max_logit_peak"] == max(s[2] for s in curve)
        assert row["steps_over_tau"] == sum(s[2] > TAU for s in curve)
        assert row["final_val_loss"] == curve[-1][5]
        if tau == NO_CLIP:  # tracked, never clipped
            assert all(s[3] == 0 for s in curve)
    table = record.with_suffix(".md").read_text()
    assert all(f"| {name} |" in table for name, *_ in RUNS)
