"""The elastic job the elastic tests share, and its gloo runs without Ray (the references
of the multi-host run): float64, the built-in tiny model, 12 sequences per step, nodes of
two ranks. The elastic run loses a host after step 5 (its last checkpoint: step 4), goes
on at 2 x 2 from step 4, loses again after step 7 and grows back to 3 x 2 from step 6;
"by hand" stops at those checkpoints and resumes from them (``checkpoint.resume_from``)
on the same layouts; "uninterrupted" runs 3 x 2 throughout. "grow" starts at 2 x 2 with
checkpoints every 4 steps, sees the workers Ray Train could start rise to 6 after step 5
(checkpointed then), is restarted by the resize after step 6 and goes on at 3 x 2 from
step 5. ``TP_SPEC`` is the multi-host job's: the same at T = 2 (3 x 1 x 2, 2 x 1 x 2),
with only its "by hand" and "uninterrupted" runs (``gloo_runs_tp``)."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile

from dmuon.testing import run
from service.job.spec import parse_spec

SPEC = {"model": "tiny", "steps": 10, "batch_size": 2, "seq_len": 32, "seed": 3,
        "precision": "float64", "global_batch_tokens": 12 * 32,
        "data": {"val_every": 0}, "export": {"enabled": False},
        "checkpoint": {"interval": 2, "keep_last": 0},
        "schedule": {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1},
        "layout": {"elastic": {"min_nodes": 2, "max_nodes": 3}, "workers_per_node": 2}}
# the multi-host job's variant: T = 2 inside each node, R varying (3 x 1 x 2, 2 x 1 x 2)
TP_SPEC = {**SPEC, "layout": {**SPEC["layout"], "tp": 2}}


class HostLost(Exception):
    """Every rank's worker stops here at once, as Ray Train stops a group that lost one."""


def _mesh(layout):
    """The plan's (replicate, shard) mesh, or (replicate, shard, tp) with T > 1: ranks in
    order, so each node's ranks (consecutive, as on Ray) hold a TP group."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.tp == 1:
        return init_device_mesh("cpu", (layout.replicate, layout.shard),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (layout.replicate, layout.shard, layout.tp),
                            mesh_dim_names=("replicate", "shard", "tp"))


def _job(rank, world, storage, job_id, stop_after=None, resume_from=None, counts=None,
         interval=2, spec_data=SPEC):
    """(records, full params on rank 0 or None when stopped) of one start of a job. With
    ``counts``, rank 0's count of the workers Ray Train could start, one a step."""
    import torch
    import torch.distributed as dist

    import dmuon
    from service.job.inputs import resolve_inputs
    from service.job.job import Job
    from service.job.plan.inventory import synthetic_inventory
    from service.job.plan.make import plan_document
    from service.worker.capacity import CapacityWatch
    from service.worker.loop import WorkerContext, run_training

    spec = parse_spec({**spec_data, "checkpoint": {**spec_data["checkpoint"],
                                                   "interval": interval,
                                                   "resume_from": resume_from}})
    plan = plan_document(spec, synthetic_inventory(3, 0, 2), 4).for_world(world)
    capacity = None if counts is None else CapacityWatch(
        iter(counts).__next__, {4, 6}, world, torch.device("cpu"), every_s=0)
    mesh = _mesh(plan.layout)
    job_dir = os.path.join(storage, job_id)
    records = []

    def report(record, path):  # the controller's spool (service.driver.reports), rank 0's
        records.append(record)
        if rank == 0:
            with open(os.path.join(job_dir, "metrics.jsonl"), "a") as fh:
                fh.write(json.dumps(record) + "\n")
        if record["step"] == stop_after:
            raise HostLost

    os.makedirs(job_dir, exist_ok=True)
    try:
        job = Job.local(spec, plan=plan, job_dir=job_dir,
                        checkpoint_dir=os.path.join(job_dir, "dcp"),
                        inputs=resolve_inputs(spec, storage, storage))
        model = run_training(job, mesh, report, WorkerContext(capacity=capacity))
    except HostLost:
        return records, None
    params = dmuon.full_state_dict(model)  # a collective: every rank gathers
    return records, params if dist.get_rank() == 0 else None


def _six(rank, world, storage):
    return {"uninterrupted": _job(rank, world, storage, "uninterrupted"),
            "elastic": _job(rank, world, storage, "elastic", stop_after=5),
            "hand": _job(rank, world, storage, "hand-a", stop_after=4)}


GROW_COUNTS = [4, 4, 4, 5, 6, 6]  # 5 workers: no layout of the plan's


def _four(rank, world, storage):
    return {"elastic": _job(rank, world, storage, "elastic", stop_after=7),
            "hand": _job(rank, world, storage, "hand-b", stop_after=6, resume_from="hand-a"),
            "grow": _job(rank, world, storage, "grow", stop_after=6, counts=GROW_COUNTS,
                         interval=4)}


def _six_again(rank, world, storage):
    return {"elastic": _job(rank, world, storage, "elastic"),
            "hand": _job(rank, world, storage, "hand-c", resume_from="hand-b"),
            "grow": _job(rank, world, storage, "grow", counts=[6] * 10, interval=4)}


@functools.cache
def gloo_runs() -> tuple[list, str]:
    """([per-rank results of 3 x 2, 2 x 2, 3 x 2 again], their storage): once a session."""
    storage = tempfile.mkdtemp(prefix="dmuon-elastic-")
    atexit.register(shutil.rmtree, storage, ignore_errors=True)
    return ([run(_six, storage, world_size=6), run(_four, storage, world_size=4),
             run(_six_again, storage, world_size=6)], storage)


def _tp_six(rank, world, storage):
    return {"uninterrupted": _job(rank, world, storage, "tp-uninterrupted", spec_data=TP_SPEC),
            "hand": _job(rank, world, storage, "tp-hand-a", stop_after=4, spec_data=TP_SPEC)}


def _tp_four(rank, world, storage):
    return {"hand": _job(rank, world, storage, "tp-hand-b", stop_after=6,
                         resume_from="tp-hand-a", spec_data=TP_SPEC)}


def _tp_six_again(rank, world, storage):
    return {"hand": _job(rank, world, storage, "tp-hand-c", resume_from="tp-hand-b",
                         spec_data=TP_SPEC)}


@functools.cache
def gloo_runs_tp() -> list:
    """TP_SPEC's references, as ``gloo_runs``' but by hand and uninterrupted only: per-rank
    results of 3 x 1 x 2, 2 x 1 x 2, 3 x 1 x 2 again."""
    storage = tempfile.mkdtemp(prefix="dmuon-elastic-tp-")
    atexit.register(shutil.rmtree, storage, ignore_errors=True)
    return [run(_tp_six, storage, world_size=6), run(_tp_four, storage, world_size=4),
            run(_tp_six_again, storage, world_size=6)]


def close(got: dict, want: dict, bound: float = 1e-9) -> None:
    """Every tensor within ``bound`` of the reference, relative to its largest entry."""
    assert set(got) == set(want)
    for key, value in want.items():
        err = ((got[key] - value).abs().max() / value.abs().max()).item()
        assert err <= bound, (key, err)
