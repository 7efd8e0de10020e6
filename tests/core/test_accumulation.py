"""Gradient accumulation: micro-batches by plain repeated backward (each one reduced and
added into the owner's gradient, as FSDP2 does) and under ``no_sync`` (summed locally,
reduced once) both equal one backward of the summed loss."""

from __future__ import annotations

import pytest
from helpers.train import hsdp_train

from dmuon.testing import run

STEPS, MICRO = 5, 3  # each rank's 4 rows as micro-batches of 2, 1 and 1
LAYOUTS = [((1, 4), False), ((1, 4), True), ((2, 2), True)]


def _three_ways(rank, world, layout, z3):
    """One backward per step, repeated backward and no_sync, in one set of processes."""
    ways = {"one": {}, "repeated": {"micro": MICRO, "accumulate": "backward"},
            "no_sync": {"micro": MICRO}}
    return {name: hsdp_train(rank, world, layout, z3=z3, steps=STEPS, **kwargs)
            for name, kwargs in ways.items()}


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("layout,z3", LAYOUTS, ids=["z2", "z3", "hsdp2x2"])
def test_repeated_backward_and_no_sync_equal_one_backward_of_the_sum(layout, z3):
    runs = run(_three_ways, layout, z3, world_size=4)
    one, repeated, no_sync = ([r[name] for r in runs] for name in ("one", "repeated", "no_sync"))
    for rank in range(4):
        for key, value in one[rank]["final"].items():
            assert _rel_err(repeated[rank]["final"][key], value) <= 1e-9, (rank, key)
            assert _rel_err(no_sync[rank]["final"][key], repeated[rank]["final"][key]) <= 1e-9
        # repeated backward reduces each micro-batch; no_sync reduces once per step
        reduce = one[rank]["ledger"]["shard"]["reduce"]
        assert repeated[rank]["ledger"]["shard"]["reduce"] == MICRO * reduce
        assert no_sync[rank]["ledger"]["shard"]["reduce"] == reduce
        if layout[0] > 1:
            replicate = one[rank]["ledger"]["replicate"]["reduce"]
            assert repeated[rank]["ledger"]["replicate"]["reduce"] == MICRO * replicate
            assert no_sync[rank]["ledger"]["replicate"]["reduce"] == replicate
