"""The training loop with non-finite steps, on 4 gloo ranks (the loop a Ray worker runs,
without Ray): rank 2's loss turns NaN at chosen steps. A skipped step is marked in every
rank's record with the ranks named; more than ``max_nonfinite_steps`` in a row fail the
job on every rank alike, naming the step, the rank and the last good checkpoint (the
first failing rank's message becomes the job's reason: tests/system/test_failure_reason.py).
The skip itself is held to a run that never saw the batch in tests/core/test_nonfinite.py.
"""

from __future__ import annotations

import os

import torch

from dmuon.testing import run

SPEC = {"model": "tiny", "steps": 8, "batch_size": 2, "seq_len": 16, "clip_grad_norm": 1.0,
        "layout": {"replicate": 2, "shard": 2}, "data": {"val_every": 0},
        "checkpoint": {"interval": 2, "keep_last": 0}, "max_nonfinite_steps": 2}


def _job(rank, world, bad_steps, directory):
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.worker import loop

    calls = {"n": 0}
    loss_of = loop.causal_lm_loss

    def injected(logits, targets):  # one micro-batch per step: call n is step n
        calls["n"] += 1
        loss = loss_of(logits, targets)
        return loss * float("nan") if rank == 2 and calls["n"] in bad_steps else loss

    loop.causal_lm_loss = injected
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    records = []
    try:
        loop.run_training(Job.local(SPEC, plan_on_one_host(SPEC), checkpoint_dir=directory), mesh,
                          lambda r, p: records.append(r))
        failure = None
    except RuntimeError as e:
        failure = str(e)
    return [(r["step"], r["skipped"], r["skipped_steps"], r["nonfinite_ranks"])
            for r in records], failure


def test_skipped_steps_are_reported_and_too_many_in_a_row_fail_naming_them(tmp_path):
    one = run(_job, {3}, str(tmp_path / "one"), world_size=4)
    for records, failure in one:
        assert failure is None
        assert records == [(s, s == 3, int(s >= 3), [2] if s == 3 else [])
                           for s in range(1, 9)]
    # steps 3, 4 and 5 in a row: the third is one more than max_nonfinite_steps=2
    many = run(_job, {3, 4, 5}, str(tmp_path / "many"), world_size=4)
    checkpoint = os.path.join(str(tmp_path / "many"), "step_000004")
    for records, failure in many:
        assert [r[0] for r in records] == [1, 2, 3, 4, 5]  # every rank stops at step 5
        assert [r[1] for r in records] == [False, False, True, True, True]
        assert failure is not None and failure.startswith("step 5: 3 steps in a row skipped")
        assert "rank(s) 2" in failure and f"last good checkpoint: {checkpoint}" in failure
    assert torch.tensor([len(r) for r, _ in many]).eq(5).all()
