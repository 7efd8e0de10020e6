"""The job path, measured (issue 44, increment 5): one submission traced in one fresh
process (``tests/helpers/job_path.py``: the control plane under a test client, the driver's
code, one worker's ``run_training``) reaches exactly the files of ``service/`` and
``dmuon/`` that ``docs/job-path.md`` lists, each under its side; a file the trace reaches
that the page does not list fails, and so does one the page lists that it does not."""

from __future__ import annotations

import os
import re

from helpers.job_trace import traced
from helpers.paths import ROOT
from test_architecture import _path_files

PATH_DOC = os.path.join(ROOT, "docs", "job-path.md")
SECTION = "## Every file the job runs, side by side"
FENCED = re.compile(r"^```text\n(.*?)^```", re.S | re.M)


def listed_by_side(text: str) -> dict[str, list[str]]:
    """The page's files, by the folder each side's heading names (``### ...: `dir/` ``):
    the first word of each line of the side's ``text`` blocks."""
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    sides = {}
    for part in section.split("\n### ")[1:]:
        folder = re.search(r"`([\w/]+/)`", part.splitlines()[0]).group(1)
        sides[folder] = [line.split()[0] for block in FENCED.findall(part)
                         for line in block.splitlines() if line.strip()]
    return sides


def test_the_traced_files_are_the_ones_the_docs_list(tmp_path):
    trace = traced(tmp_path)
    files = trace["files"]
    print(f"\nthe files of one job's path, traced ({len(files)}):\n" + "\n".join(files))
    sides = listed_by_side(open(PATH_DOC).read())
    assert list(sides) == ["service/control/", "service/driver/", "service/worker/",
                           "service/job/", "dmuon/"]
    listed = [f for side in sides.values() for f in side]
    assert len(listed) == len(set(listed)), "a file listed twice"
    assert {"not listed": sorted(set(files) - set(listed)),
            "not reached": sorted(set(listed) - set(files))} == {
        "not listed": [], "not reached": []}
    assert {f for folder, side in sides.items() for f in side
            if not f.startswith(folder)} == set(), "a file under another side's heading"
    # the hand-off files, in order above, are on the measured path too
    assert set(_path_files()) <= set(files), sorted(set(_path_files()) - set(files))
    # the control plane handed the driver the spec and the plan in the job's directory
    assert {"spec.json", "plan.json", "rank_records", "export"} <= set(trace["job_dir"])
    # the planner has one home: the control plane plans; the driver only checks the
    # stored plan against the live cluster (check_fits; with_batch_splits for a
    # document stored before layouts carried the batch split); the worker plans nothing
    by_side = trace["by_side"]
    planner = lambda side: sorted(f for f in by_side[side] if f.startswith("service/job/plan/"))  # noqa: E731
    assert "service/job/plan/predict.py" in planner("control")
    assert planner("driver") == ["service/job/plan/layout_choice.py", "service/job/plan/make.py"]
    assert planner("worker") == []

