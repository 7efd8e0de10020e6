"""Pipeline parallelism measured on this machine, for ``bench.pp_plan``'s record: the
built-in ``small`` model (4 layers, hidden 256, FFN 768, vocabulary 256) on 4 gloo ranks,
fp32 and NS in fp32, DMuon Z2 (``dedicate_stage``'s default), a global batch of
``GLOBAL_ROWS`` sequences of ``SEQ`` tokens per step, as PP 2 x FSDP 2 (``split_stages``'s
two stages, ``dmuon.PipelineStage`` and ``PipelineMuon``, torch's ``Schedule1F1B`` over
``MICRO`` micro-batches) against FSDP 4 (``dedicate_params`` + ``Muon``, one forward and
backward of its rows). Per layout: the bytes of a step by ledger dim (the median rank;
the ``pp`` dim is what the stages send each other), the median step time after warm-up
steps, and, for the pipeline, each stage's time inside its own forward and backward
chunks (``forward_one_chunk``, ``backward_one_chunk``): the rest of the schedule's time
is waiting, the bubble measured, beside the predicted (pp-1)/(m+pp-1)."""

from __future__ import annotations

import statistics
import time

import torch

WARMUP, TIMED, GLOBAL_ROWS, SEQ, MICRO, MODEL = 2, 5, 16, 64, 4, "small"
HPARAMS = dict(lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)


def _timed(stage, clock: list) -> None:
    """Add the seconds spent in ``stage``'s forward and backward chunks to ``clock[0]``."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        inner = getattr(stage, name)

        def wrapped(*a, _inner=inner, **k):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                clock[0] += time.perf_counter() - t0
        setattr(stage, name, wrapped)


def _pipeline(mesh, model, predicate):
    from torch.distributed.pipelining import Schedule1F1B

    import dmuon
    from service.job.models.builtin import causal_lm_loss
    from service.job.models.stages import split_stages

    p = mesh["pp"].get_local_rank()
    module = split_stages(model, 2)[p]
    dmuon.dedicate_stage(module, mesh["shard"], predicate)
    for layer in module.model.layers.values():
        dmuon.fully_shard(layer, mesh=mesh["shard"], reshard_after_forward=False)
    dmuon.fully_shard(module, mesh=mesh["shard"], reshard_after_forward=False)
    rows, dim = GLOBAL_ROWS // mesh["shard"].size() // MICRO, model.config.dim
    act = torch.empty(rows, SEQ, dim, requires_grad=True)
    inp = torch.zeros(rows, SEQ, dtype=torch.long) if p == 0 else act
    out = torch.empty(rows, SEQ, model.config.vocab_size) if p == 1 else act
    stage = dmuon.PipelineStage(module, p, 2, torch.device("cpu"), input_args=inp,
                                output_args=out, group=mesh["pp"].get_group())
    opt = dmuon.PipelineMuon([stage], **HPARAMS)
    return stage, opt, Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=causal_lm_loss)


def _measure(rank, world, layout: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.job.models.builtin import build_model, causal_lm_loss, get_config
    from service.job.models.params import split_params
    from service.worker.corpus import batch_at, load_corpus

    torch.set_num_threads(1)
    pp = 2 if layout == "PP 2 x FSDP 2" else 1
    mesh = init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "shard"))
    model = build_model(get_config(MODEL), seed=0)
    predicate = split_params(model).predicate
    if pp > 1:
        stage, opt, schedule = _pipeline(mesh, model, predicate)
        owner, clock = stage.submod, [0.0]
        _timed(stage, clock)
    else:
        dmuon.dedicate_params(model, mesh["shard"], predicate=predicate,
                              reshard_after_forward=False)
        for layer in model.model.layers:
            dmuon.fully_shard(layer, mesh=mesh["shard"], reshard_after_forward=False)
        dmuon.fully_shard(model, mesh=mesh["shard"], reshard_after_forward=False)
        opt, owner, clock = dmuon.Muon(model, **HPARAMS), model, [0.0]
    corpus = load_corpus("train", max_bytes=2_000_000)
    d, dp = mesh["shard"].get_local_rank(), mesh["shard"].size()
    times, busy = [], []
    for step in range(WARMUP + TIMED):
        rows = batch_at(corpus, step, GLOBAL_ROWS, SEQ)[d * GLOBAL_ROWS // dp:
                                                            (d + 1) * GLOBAL_ROWS // dp]
        dist.barrier()
        start, clock[0] = time.perf_counter(), 0.0
        if pp > 1:
            first = stage.is_first
            schedule.step(*((rows[:, :-1],) if first else ()),
                          **({} if first else {"target": rows[:, 1:]}))
            busy.append(clock[0] / (time.perf_counter() - start))
        else:
            causal_lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    ledger = dmuon.get_ledger(owner).last_step_by_phase()
    return {"bytes": {dim: sum(phases.values()) for dim, phases in ledger.items()},
            "pp_phases": dict(ledger.get("pp", {})),
            "step_s": statistics.median(times[WARMUP:]), "pp_rank": rank // (world // pp),
            "busy": statistics.median(busy[WARMUP:]) if busy else None}


def measured() -> list[dict]:
    """One row per layout: median bytes by dim, step time, and the pipeline's bubble."""
    from dmuon.testing import run

    out = []
    for layout in ("FSDP 4", "PP 2 x FSDP 2"):
        results = run(_measure, layout, world_size=4)
        dims = sorted({d for r in results for d in r["bytes"]})
        row = {"layout": layout, "step_s": statistics.median(r["step_s"] for r in results),
               "bytes": {d: statistics.median(r["bytes"].get(d, 0) for r in results)
                         for d in dims},
               "bytes_by_rank": [r["bytes"] for r in results],
               "pp_phases_by_rank": [r["pp_phases"] for r in results]}
        if results[0]["busy"] is not None:
            row["bubble_by_pp_rank"] = [
                1 - statistics.median(r["busy"] for r in results if r["pp_rank"] == k)
                for k in (0, 1)]
            row["bubble_predicted"] = (2 - 1) / (MICRO + 2 - 1)
        out.append(row)
    return out
