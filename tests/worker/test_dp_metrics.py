"""Figures averaged over ranks count each data-parallel rank once: the service's training
loop (``run_training``) on gloo ranks, R x N and R x N x T, against a single-process
float64 evaluation of the same weights on the same rows (the tests' own model,
``tests/helpers/model.py``). Under tensor parallelism the T ranks of a group hold the same
loss; the validation loss once came out T times too large."""

from __future__ import annotations

import pytest
import torch
from helpers.model import build_model, causal_lm_loss, get_config

from dmuon.testing import run

STEPS, MICROS, PER_RANK = 2, 2, 1
SPEC = {"model": "tiny", "steps": STEPS, "batch_size": PER_RANK, "seq_len": 16,
        "precision": "float64", "seed": 3, "export": {"enabled": False},
        "data": {"val_every": STEPS, "val_batches": 2}}


def _spec(layout):
    from service.job.spec import parse_spec

    dims = dict(zip(("replicate", "shard", "tp"), layout))
    dp = layout[0] * layout[1]
    return parse_spec({**SPEC, "layout": dims,
                       "global_batch_tokens": MICROS * dp * PER_RANK * SPEC["seq_len"]})


def _job(rank, world, layout):
    """(initial weights, trained weights, this rank's records)."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.worker.loop import build_training, run_training

    names = ("replicate", "shard", "tp")[:len(layout)]
    mesh = init_device_mesh("cpu", layout, mesh_dim_names=names)
    spec = _spec(layout)
    initial = dmuon.full_state_dict(build_training(spec, mesh)[0])
    records = []
    model = run_training(Job.local(spec, plan_on_one_host(spec)), mesh,
                         lambda record, path: records.append(record))
    trained = dmuon.full_state_dict(model)
    return (initial, trained, records) if rank == 0 else (None, None, records)


def _reference_loss(weights: dict, split: str, batches: list[int], rows: int) -> float:
    """The mean next-token loss of ``weights`` over every row of the given batches, one
    float64 process."""
    from service.worker.batches import Batches

    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    model.load_state_dict(weights)
    data = Batches({"kind": "builtin"}, split, SPEC["seq_len"], SPEC["seed"], 0.05)
    with torch.no_grad():
        losses = [causal_lm_loss(model(t[:, :-1]), t[:, 1:]).item()
                  for t in (data.rows(i, rows, 0, 1) for i in batches)]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 2, 2), (2, 2), (1, 4)],
                         ids=lambda layout: "x".join(map(str, layout)))
def test_losses_average_the_data_parallel_ranks(layout):
    world = 1
    for size in layout:
        world *= size
    results = run(_job, layout, world_size=world)
    initial, trained = results[0][0], results[0][1]
    rows = MICROS * layout[0] * layout[1] * PER_RANK
    want_val = _reference_loss(trained, "val", list(range(SPEC["data"]["val_batches"])), rows)
    for rank, (_, _, records) in enumerate(results):
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), rank
        got = records[-1]["val_loss"]
        assert abs(got - want_val) <= 1e-9 * want_val, (rank, got, want_val)
    # the training loss as the trackers show it: the mean of every rank's record
    want_train = _reference_loss(initial, "train", [0], rows)
    first = [records[0]["loss"] for _, _, records in results]
    assert abs(sum(first) / len(first) - want_train) <= 1e-9 * want_train, (first, want_train)
    # tokens in total: each data-parallel rank's rows once, not once per TP rank
    tokens = rows * SPEC["seq_len"]
    for _, _, records in results:
        r = records[-1]
        assert abs(r["tokens_per_s_total"] * r["step_time_s"] - tokens) <= 1e-6 * tokens
