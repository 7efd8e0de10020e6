"""An elastic job's training through a resize and back (``layout.elastic``), the CPU
shadow of a Ray Train worker group that loses a host and regains it: the loop a Ray
worker runs, on gloo ranks without Ray, each start on the layout its plan gives its
world size. Float64, the built-in tiny model, 12 sequences per step.

The elastic job runs 3 x 2, loses a host after step 5 (its last checkpoint: step 4),
goes on at 2 x 2 from step 4 (3 micro-batches of 1 row per rank instead of 1 of 2),
loses again after step 7 and grows back to 3 x 2 from step 6. Its final parameters are
within 1e-9 (relative, per tensor: the bound of tests/core/test_checkpoint.py's resharded
loads) of a run never interrupted (the layouts change only the order of the sums), and
``torch.equal`` to a run stopped at the same checkpoints and resumed by hand
(``checkpoint.resume_from``) on the same layouts. Each start is a layout event with its
reason, the layouts before and after and the steps lost."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.elastic import GROW_COUNTS, close, gloo_runs


@pytest.fixture(scope="module")
def runs():
    return gloo_runs()


def _mean_loss(ranks: list[dict], job: str) -> dict[int, float]:
    """Step -> the mean of every rank's loss: each rank's is the mean over its own rows,
    and every rank has as many rows, so this is the global batch's mean loss."""
    losses: dict[int, list[float]] = {}
    for out in ranks:
        for r in out[job][0]:
            losses.setdefault(r["step"], []).append(r["loss"])
    assert all(len(v) == len(ranks) for v in losses.values())
    return {step: sum(v) / len(v) for step, v in losses.items()}


def test_a_resized_run_ends_where_an_uninterrupted_one_does(runs):
    (six, four, again), _ = runs
    steps = [[(r["step"], r["resumed_from"], tuple(r["layout"])) for r in out["elastic"][0]]
             for out in (six[0], four[0], again[0])]
    assert steps == [[(s, 0, (3, 2)) for s in range(1, 6)],
                     [(s, 4, (2, 2)) for s in range(5, 8)],
                     [(s, 6, (3, 2)) for s in range(7, 11)]]
    want = _mean_loss(six, "uninterrupted")
    for segment in (six, four, again):  # each step's loss over all ranks, on any layout
        for step, loss in _mean_loss(segment, "elastic").items():
            assert abs(loss - want[step]) <= 1e-9 * abs(want[step]), step
    final = again[0]["elastic"][1]
    close(final, six[0]["uninterrupted"][1])
    by_hand = again[0]["hand"][1]
    for key, value in by_hand.items():
        assert torch.equal(final[key], value), key


def test_each_start_is_a_layout_event_with_its_reason_and_the_steps_lost(runs):
    (six, four, again), storage = runs
    events = [out[0]["elastic"][0][0]["layout_event"] for out in (six, four, again)]
    assert events == [
        {"reason": "start", "previous": None, "layout": [3, 2], "resumed_from": 0,
         "steps_lost": 0},
        {"reason": "capacity lost: 6 -> 4 workers (a node or worker failed)",
         "previous": [3, 2], "layout": [2, 2], "resumed_from": 4, "steps_lost": 1},
        {"reason": "capacity returned: 4 -> 6 workers", "previous": [2, 2],
         "layout": [3, 2], "resumed_from": 6, "steps_lost": 1}]
    for out in (six, four, again):  # rank 0's first record only; no other carries one
        assert all(r["layout_event"] is None for r in out[0]["elastic"][0][1:])
        assert all(r["layout_event"] is None for rank in out[1:] for r in rank["elastic"][0])
    with open(os.path.join(storage, "elastic", "layouts.jsonl")) as fh:
        logged = [json.loads(line) for line in fh]
    assert [{k: v for k, v in e.items() if k != "time"} for e in logged] == events


def test_a_rise_in_capacity_is_checkpointed_and_the_resize_resumes_there(runs):
    """Rank 0's count of the workers Ray Train could start (tests/helpers/elastic.GROW_COUNTS, one
    a step) reaches a planned layout, 6, after step 5 of a 2 x 2 run that checkpoints
    every 4: that step is checkpointed (once, though the count stays at 6; the 5 before
    it names no layout of the plan's), and the resize that comes a step later resumes
    from it, losing one step instead of two."""
    (six, four, again), storage = runs
    grow = four[0]["grow"][0]
    assert [r["capacity"] for r in grow] == GROW_COUNTS
    for out in four:  # every rank has rank 0's count
        assert [r["capacity"] for r in out["grow"][0]] == GROW_COUNTS
    dcp = os.path.join(storage, "grow", "dcp")
    assert sorted(os.listdir(dcp)) == [f"step_{s:06d}" for s in (4, 5, 8, 10)]
    assert again[0]["grow"][0][0]["layout_event"] == {
        "reason": "capacity returned: 4 -> 6 workers", "previous": [2, 2],
        "layout": [3, 2], "resumed_from": 5, "steps_lost": 1}
    assert [(r["step"], r["resumed_from"]) for r in again[0]["grow"][0]] == [
        (s, 5) for s in range(6, 11)]
    close(again[0]["grow"][1], six[0]["uninterrupted"][1])
