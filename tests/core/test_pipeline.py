"""Pipeline parallelism (issue 52, the core): PP 2 x FSDP 2 on 4 gloo ranks under
torch.distributed.pipelining's schedules, every param within 1e-9 of the float64
single-process reference (torch.optim.Muon + AdamW on the global batch's mean loss)."""

from __future__ import annotations

import pytest
import torch
from _pipeline import CONFIG, pp_train
from _train import reference_run

from dmuon.testing import run

STEPS = 10


def _merged(results: list[dict], key: str = "final") -> dict:
    """Each FQN's full value, checked equal on every rank that holds it."""
    out: dict = {}
    for r in results:
        for fqn, value in r[key].items():
            if fqn in out:
                assert (out[fqn] == value).all(), fqn
            out[fqn] = value
    return out


def _assert_matches_reference(results: list[dict]) -> None:
    expected, losses = reference_run(STEPS, config=CONFIG)
    got = _merged(results)
    assert sorted(got) == sorted(expected)
    for fqn, value in expected.items():
        err = ((got[fqn] - value).abs().max() / value.abs().max()).item()
        assert err <= 1e-9, (fqn, err)
    for r in results:  # the last stage's loss, the same on every rank
        assert r["losses"] == pytest.approx(losses, rel=1e-9)


def test_1f1b_pp2_fsdp2_matches_the_reference():
    _assert_matches_reference(run(pp_train, schedule="1f1b", world_size=4))


def _reduce_bytes(rank, world, micro):
    out = pp_train(rank, world, schedule="gpipe", steps=2, micro=micro)  # 1F1B wants m >= 2
    return {i: ledger["shard"]["reduce"] for i, ledger in out["ledgers"].items()}


def test_the_reduce_goes_out_once_per_step_whatever_the_micro_batch_count():
    """The shard dim's reduce bytes of a step at 1 and at 8 micro-batches are equal:
    DMuon's reduce follows the schedule's last backward, not each micro-batch's."""
    one, eight = run(_reduce_bytes, 1, world_size=4), run(_reduce_bytes, 8, world_size=4)
    assert one == eight
    assert all(v > 0 for r in one for v in r.values())


@pytest.mark.parametrize("schedule,split", [("gpipe", "two"), ("interleaved", "four"),
                                            ("1f1b", "embedding_alone")],
                         ids=["gpipe", "interleaved_2_stages_per_rank", "stage_without_muon"])
def test_schedule_matches_the_reference(schedule, split):
    """GPipe; interleaved 1F1B with stages p and p + 2 on each rank (one PipelineMuon over
    both); and a first stage holding only the embedding (no Muon matrix)."""
    _assert_matches_reference(run(pp_train, schedule=schedule, split=split, world_size=4))


def _z2_and_z3(rank, world):
    return {z3: pp_train(rank, world, z3=z3, steps=4)["final"] for z3 in (False, True)}


def test_z3_equals_z2_bit_for_bit():
    for r in run(_z2_and_z3, world_size=4):
        assert r[False].keys() == r[True].keys()
        for fqn, value in r[False].items():
            assert torch.equal(r[True][fqn], value), fqn
