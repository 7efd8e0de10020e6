"""The test suite's time at two commits, on one machine: each from a clean clone
(``bash .ci/run``, every test's durations printed), then the tests both commits hold (by
function name: tests moved between folders keep their names) against the tests one
commit added, so a change that slows the tests it kept reads apart from new tests.

``python -m bench.suite_time --then 3b1d3f1 --now HEAD`` clones and runs both (about
an hour on 2 cores); ``--then-log``/``--now-log`` read logs of such runs instead."""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

from bench._record import write_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DURATION = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+)", re.M)
_SUMMARY = re.compile(r"^=*\s*(.*?) in ([\d.]+)s", re.M)


def parse_log(text: str) -> dict:
    """A pytest log's outcome counts, its time, and seconds per test function and file."""
    by_test, file_of = collections.Counter(), {}
    for seconds, node in _DURATION.findall(text):
        name = node.split("::")[-1].split("[")[0]
        by_test[name] += float(seconds)
        file_of[name] = node.split("::")[0]
    summary = _SUMMARY.findall(text)
    if not summary:
        raise ValueError("no pytest summary line ('N passed ... in S s') in the log")
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary[-1][0])}
    return {"counts": counts, "seconds": float(summary[-1][1]), "by_test": dict(by_test),
            "file_of": file_of}


def _added(then: dict, now: dict) -> set[str]:
    """The test functions only ``now`` holds."""
    return set(now["by_test"]) - set(then["by_test"])


def compare(then: dict, now: dict) -> dict:
    """The test functions both runs hold, summed in each; those only ``now`` holds."""
    added = _added(then, now)
    kept = set(now["by_test"]) - added
    return {"kept_tests": len(kept), "added_tests": len(added),
            "kept_then_s": sum(then["by_test"][t] for t in kept),
            "kept_now_s": sum(now["by_test"][t] for t in kept),
            "added_now_s": sum(now["by_test"][t] for t in added),
            "dropped_then_s": sum(s for t, s in then["by_test"].items() if t not in kept)}


def table(then: dict, now: dict, cmp: dict, commits: tuple[str, str]) -> str:
    rows = ["| | at " + commits[0] + " | at " + commits[1] + " |", "|---|---:|---:|",
            *(f"| tests {outcome} | {then['counts'].get(outcome, 0)} | "
              f"{now['counts'].get(outcome, 0)} |" for outcome in ("passed", "failed")),
            f"| pytest s | {then['seconds']:.0f} | {now['seconds']:.0f} |",
            f"| the {cmp['kept_tests']} test functions both hold, s | {cmp['kept_then_s']:.0f} "
            f"| {cmp['kept_now_s']:.0f} |",
            f"| the {cmp['added_tests']} test functions added, s | - | "
            f"{cmp['added_now_s']:.0f} |"]
    return "\n".join(rows)


def added_by_file(then: dict, now: dict, top: int = 8) -> str:
    """The files whose added test functions take longest: where the added time went."""
    files = collections.Counter()
    for name in _added(then, now):
        files[now["file_of"][name]] += now["by_test"][name]
    return "\n".join(f"- `{f}`: {s:.0f} s" for f, s in files.most_common(top))


def run_suite(commit: str, workdir: str) -> str:
    """``.ci/run`` on a clean clone of ``commit``, every test's duration kept: its log."""
    clone = os.path.join(workdir, commit)
    subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    subprocess.run(["git", "-C", clone, "checkout", "-q", commit], check=True)
    env = {**os.environ, "PYTEST_ADDOPTS": "--durations=0 --durations-min=0"}
    proc = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env, capture_output=True,
                          text=True)
    return proc.stdout + proc.stderr


def _short(commit: str) -> str:
    """``HEAD`` or a name as the commit it is, where this checkout knows it."""
    proc = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", commit],
                          capture_output=True, text=True)
    return proc.stdout.strip() or commit


def _cpu() -> str:
    with open("/proc/cpuinfo") as fh:
        names = re.findall(r"^model name\s*:\s*(.*)$", fh.read(), re.M)
    return names[0] if names else "unknown CPU"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.suite_time", description=__doc__)
    ap.add_argument("--then", default="3b1d3f1", help="the earlier commit")
    ap.add_argument("--now", default="HEAD", help="the later commit")
    ap.add_argument("--then-log", help="a log of the earlier commit's run, instead of a run")
    ap.add_argument("--now-log", help="a log of the later commit's run, instead of a run")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        logs = [open(path).read() if path else run_suite(commit, work) for path, commit in
                ((args.then_log, args.then), (args.now_log, args.now))]
    then, now = (parse_log(text) for text in logs)
    cmp = compare(then, now)
    commits = tuple(_short(c) for c in (args.then, args.now))
    text = table(then, now, cmp, commits)
    added, cpu = added_by_file(then, now), _cpu()
    print(text + "\n\nWhere the added tests' time went:\n" + added)
    print(write_record("suite_time", "The suite's time at two commits", text,
                       {"then": commits[0], "now": commits[1], "cpu": cpu, **cmp,
                        "then_s": then["seconds"], "now_s": now["seconds"]},
                       notes=f"Where the added tests' time went:\n{added}\n\nCPU: {cpu}; "
                             "each run from a clean clone, `bash .ci/run` with every "
                             "test's durations printed. A log printed with pytest's default "
                             "`--durations-min` (5 ms) leaves out the test functions whose "
                             "every phase took less: they are not counted here."))


if __name__ == "__main__":
    main()
