"""Each rank's own record of every step it ran, on shared storage, written before the
step's report (and before its checkpoint commits): ``<job>/rank_records/rank_R.jsonl``.

Why: a worker's report reaches ``metrics.jsonl`` only when Ray Train's controller polls
it, one report at a time, so a job stopped mid-run (a cancel) loses the last step or two
still on their way; the control plane adds these records when Ray says the job ended
(``service.control.step_records.read_rank_records``), and a stopped job's metrics run from step 1
to the last step it ran, with no hole. One file per rank: appends from several hosts to
one file on shared storage are not atomic."""

from __future__ import annotations

import json
import os

from service.job.job_dir import RANK_RECORDS


def keep_record(job_dir: str | None, record: dict) -> None:
    """Append this rank's record of the step it just ran (nowhere without ``job_dir``:
    a run outside a job, as in the tests)."""
    if not job_dir:
        return
    folder = os.path.join(job_dir, RANK_RECORDS)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"rank_{record['rank']:05d}.jsonl"), "a") as fh:
        fh.write(json.dumps(record) + "\n")
