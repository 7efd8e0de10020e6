"""On the Ray Train controller: every step's per-rank records to the job's spool, one
readable line per step to stdout, and the records to the control plane."""

from __future__ import annotations

import json
import math
import os
import sys

from ray.train.v2.api.callback import UserCallback

from service.job.job_dir import METRICS


def _number(value, digits: int = 4) -> str:
    if value is None or not math.isfinite(value):
        return "non-finite"
    return f"{value:.{digits}g}" if abs(value) < 1e-3 else f"{value:.{digits}f}"


def _lr(value) -> str:
    """An LR in one format whatever its size (a schedule takes it over decades)."""
    return "non-finite" if value is None or not math.isfinite(value) else f"{value:.3e}"


def step_line(records: list[dict]) -> str:
    """One step in a line a person reads: the loss averaged over the ranks (what the
    dashboard, TensorBoard and ``dmuon-svc submit --follow`` show), rank 0's LR per group
    and step time, the validation loss on validation steps, QK-clip's largest logit and
    clipped heads when it is on, a skipped step marked.
    ``step 3  loss 5.2625 (mean of 4 ranks)  lr muon 2.000e-02 adamw 3.000e-03  0.122 s/step``"""
    first = min(records, key=lambda r: r["rank"])
    losses = [r.get("loss") for r in records]
    mean = (None if any(v is None or not math.isfinite(v) for v in losses)
            else sum(losses) / len(losses))
    parts = [f"step {first['step']}",
             f"loss {_number(mean)} (mean of {len(records)} rank{'s' * (len(records) > 1)})"]
    if first.get("val_loss") is not None:
        parts.append(f"val_loss {_number(first['val_loss'])}")
    lrs = first.get("lr") or {}
    if lrs:
        parts.append("lr " + " ".join(f"{k} {_lr(v)}" for k, v in lrs.items()))
    if first.get("max_logit") is not None:  # QK-clip's: the same on every rank
        parts.append(f"max_logit {_number(first['max_logit'])}  clipped_heads "
                     f"{first.get('clipped_heads') or 0}")
    if first.get("step_time_s") is not None:
        parts.append(f"{first['step_time_s']:.3f} s/step")
    if first.get("skipped"):
        parts.append("skipped: non-finite gradient")
    return "  ".join(parts)


class MetricsCallback(UserCallback):
    """On the Ray Train controller: one JSONL record per (step, rank) in
    ``<dir>/metrics.jsonl`` (durable: written first), one line per step on stdout
    (``step_line``), and a post to the control plane with the job's own token (fast)."""

    def __init__(self, job_id: str, out_dir: str, post_url: str | None = None,
                 token: str | None = None):
        self.job_id, self.post_url, self.token = job_id, post_url, token
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, METRICS)
        self.failed_posts = 0  # in a row: reported once, and once more when they work again

    def after_report(self, run_context, metrics, checkpoint):
        records = [{"job_id": self.job_id, **m} for m in metrics]
        with open(self.path, "a") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
        print(step_line(records), flush=True)
        if self.post_url:
            self._post(records)

    def _post(self, records: list[dict]) -> None:
        """A failure is reported when posts start to fail and when they work again, not
        once a step: the spool keeps every record, and the service re-reads it."""
        error = send(self.post_url, records, self.token, report=False)
        if error is not None:
            if not self.failed_posts:
                print(f"post to {self.post_url} failed: {error} (the spool keeps the "
                      "records; not reported again until a post succeeds)", file=sys.stderr,
                      flush=True)
            self.failed_posts += 1
        elif self.failed_posts:
            print(f"posts to {self.post_url} work again after {self.failed_posts} "
                  "failed", file=sys.stderr, flush=True)
            self.failed_posts = 0


def send(url: str, body, token: str | None, method: str = "post",
         report: bool = True) -> str | None:
    """A request with the job's own token; a failure is returned (and with ``report``
    printed), not raised: the spool keeps the records, and the service re-reads it."""
    import requests

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        requests.request(method, url, json=body, headers=headers, timeout=5).raise_for_status()
    except requests.RequestException as e:
        if report:
            print(f"{method} to {url} failed: {e}", file=sys.stderr)
        return str(e)
    return None
