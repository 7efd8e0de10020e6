"""``bench.suite_time`` on two small pytest logs written here: the counts, the time and
the kept and added tests' sums equal what the logs say, summed by hand; a log without
pytest's summary line is refused by name; the record goes to ``$OUT``."""

from __future__ import annotations

import json

import pytest

from bench import suite_time

THEN = """........ [100%]
============================= slowest durations ==============================
10.00s call     tests/test_a.py::test_kept[1]
2.50s setup    tests/test_a.py::test_kept[1]
1.00s call     tests/test_a.py::test_kept[2]
4.00s call     tests/test_b.py::test_dropped
========================= 3 passed, 1 warning in 20.50s =========================
"""
NOW = """........ [100%]
8.00s call     tests/core/test_a.py::test_kept[1]
0.50s teardown tests/core/test_a.py::test_kept[2]
6.00s call     tests/system/test_c.py::test_added
1.00s call     tests/core/test_d.py::test_also_added[x]
1 failed, 4 passed in 17.25s
"""


def test_two_logs_compare_by_test_function():
    then, now = suite_time.parse_log(THEN), suite_time.parse_log(NOW)
    assert then["counts"] == {"passed": 3, "warning": 1} and then["seconds"] == 20.5
    assert now["counts"] == {"failed": 1, "passed": 4} and now["seconds"] == 17.25
    cmp = suite_time.compare(then, now)
    # test_kept moved from tests/ to tests/core/ and keeps its name: it is kept
    assert cmp == {"kept_tests": 1, "added_tests": 2, "kept_then_s": 13.5,
                   "kept_now_s": 8.5, "added_now_s": 7.0, "dropped_then_s": 4.0}
    assert suite_time.added_by_file(then, now).splitlines() == [
        "- `tests/system/test_c.py`: 6 s", "- `tests/core/test_d.py`: 1 s"]
    text = suite_time.table(then, now, cmp, ("old", "new"))
    assert "| pytest s | 20 | 17 |" in text and "| tests failed | 0 | 1 |" in text


def test_a_log_without_a_summary_line_is_refused():
    with pytest.raises(ValueError, match="no pytest summary line"):
        suite_time.parse_log("1.00s call tests/test_a.py::test_x\n")


def test_the_record_is_written_from_two_logs(tmp_path, monkeypatch):
    (tmp_path / "then.log").write_text(THEN)
    (tmp_path / "now.log").write_text(NOW)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    suite_time.main(["--then", "old", "--now", "new", "--then-log", str(tmp_path / "then.log"),
                     "--now-log", str(tmp_path / "now.log")])
    record, = (tmp_path / "out").glob("suite_time_*.json")
    data = json.loads(record.read_text())
    assert (data["then"], data["now"], data["then_s"], data["now_s"]) == ("old", "new", 20.5,
                                                                          17.25)
    assert data["kept_now_s"] == 8.5 and data["added_tests"] == 2
