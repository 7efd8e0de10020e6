"""A job with NorMuon and QK-clip: the spec's options reach the workers' optimizer, and
each step's record carries QK-clip's figures (the same on every rank), which the control
plane accepts and the trackers take. The workers' loop (``run_training``) on 1 x 2 x 2
gloo ranks (TP: each rank holds its own heads); the numbers themselves are checked
against float64 references in tests/core/test_normuon.py and test_qk_clip.py."""

from __future__ import annotations

from dmuon.testing import run

TAU, STEPS = 0.05, 3  # low enough that the tiny model's heads go over it at once
SPEC = {"model": "tiny", "steps": STEPS, "batch_size": 1, "seq_len": 16,
        "precision": "float64", "seed": 3, "export": {"enabled": False},
        "layout": {"replicate": 1, "shard": 2, "tp": 2},
        "optimizer": {"variant": "normuon", "beta2": 0.9, "qk_clip": {"tau": TAU}}}


def _job(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.worker.loop import run_training

    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    records = []
    run_training(Job.local(SPEC, plan_on_one_host(SPEC)), mesh,
                 lambda record, path: records.append(record))
    return records


def test_normuon_and_qk_clip_reach_the_records():
    from service.control.step_records import StepRecord
    from service.driver.reports import step_line
    from service.driver.tracking_callback import step_scalars

    results = run(_job, world_size=4)
    for step in range(STEPS):
        rows = [records[step] for records in results]
        assert len({(r["max_logit"], r["clipped_heads"]) for r in rows}) == 1, step
        assert rows[0]["max_logit"] > TAU and rows[0]["clipped_heads"] > 0, rows[0]
        for r in rows:  # the control plane takes them as they are
            stored = StepRecord.model_validate({"job_id": "j", **r})
            assert stored.max_logit == r["max_logit"], step
        line = step_line(rows)  # what `dmuon-svc logs` shows of the step
        assert (f"  max_logit {rows[0]['max_logit']:.4f}  clipped_heads "
                f"{rows[0]['clipped_heads']}") in line, line
        assert f"lr muon {rows[0]['lr']['muon']:.3e} adamw " in line, line
        scalars = step_scalars(rows)
        assert scalars["max_logit"] == rows[0]["max_logit"], step
        assert scalars["clipped_heads"] == rows[0]["clipped_heads"], step
