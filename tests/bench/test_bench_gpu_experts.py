"""``bench.gpu_experts`` in its CPU form: both paths of the experts' backward timed on
the same rows, the grouped one's gradients equal to the select loop's (float32 on the
CPU: the same products, one ``unbind`` instead of a select per expert)."""

from __future__ import annotations

import torch

from bench.gpu_experts import SIZES, experts_backward_rows, table_rows


def test_the_tiny_rows_time_both_paths_and_agree():
    rows = experts_backward_rows(torch.device("cpu"), tiny=True)
    assert [r["path"] for r in rows] == ["select_loop", "grouped"]
    assert rows[1]["kernel"] == "unbind"  # grouped_mm runs on CUDA bf16 only
    for r in rows:
        assert r["backward_ms"] > 0 and r["experts"] == SIZES["tiny"]["experts"]
    assert rows[1]["grad_rel_diff"] <= 1e-6
    assert len(table_rows(rows)) == 2
