"""The steps ``dmuon.Muon`` (or ``dmuon.PipelineMuon``) skipped for a non-finite
gradient, as a job's records mark them and when it fails for them."""

from __future__ import annotations


class NonfiniteSteps:
    """Steps ``dmuon.Muon`` skipped for a non-finite gradient (every rank skips the same
    ones): marked in each record; after more than ``allowed`` in a row the job fails,
    naming the step, the ranks and the last good checkpoint."""

    def __init__(self, allowed: int, start: int):
        self.allowed, self.in_a_row, self.last_skip = allowed, 0, None
        self.last_good = f"step {start} (resumed)" if start else None
        self._seen = 0

    def after_step(self, opt, record: dict, step: int) -> None:
        skipped = opt.skipped_steps > self._seen
        self._seen = opt.skipped_steps
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped:
            self.last_skip = (step, list(opt.nonfinite_ranks))
        record.update(skipped=skipped, skipped_steps=opt.skipped_steps,
                      nonfinite_ranks=list(opt.nonfinite_ranks) if skipped else [])

    def check(self) -> None:
        if self.in_a_row > self.allowed:
            step, ranks = self.last_skip
            raise RuntimeError(
                f"step {step}: {self.in_a_row} steps in a row skipped for a non-finite "
                f"gradient (more than max_nonfinite_steps={self.allowed}); not finite on "
                f"rank(s) {', '.join(map(str, ranks))}; last good checkpoint: "
                f"{self.last_good or 'none (no checkpoint committed yet)'}")
