"""A pipeline-parallel job's run (``layout.pp`` > 1) on a built ``(pp, replicate, shard)``
mesh: the model built on the meta device, cut into the stages the stored plan lists
(``plan.pipeline["stages"]``: each stage's layers ``[lo, hi)``, the split the planner
stored, never one made again here), this rank's stage(s) (``p, p + pp, ...``) each
dedicated by ``dmuon.dedicate_stage`` over its stage's data-parallel mesh (the EP group
inside it cut by ``dmuon.shard_experts``), then FSDP2; torch's schedule named by
``layout.pp_schedule`` over ``layout.micro_batches``; one ``dmuon.PipelineMuon``.

Each stage's DMuon partition is made here, from the stage module and its mesh: the
same on every rank of the stage (``dmuon.partition``'s greedy balance: largest unit
first, ties by position), so the plan stores the stage split, not a
partition per stage; every rank reports its stages' partition digests and layers.

Per step every rank reports the same loss (``PipelineMuon.step_loss``: the last stage's
micro-batch losses over its data-parallel ranks), and at ``val_every`` the validation
loss (the schedule's forward-only ``eval``), records as a job without PP does.
Checkpoints are FQN-keyed (``dmuon.pipeline_state``): they load on any pp degree. The
export writes each stage's share of the weights, by FQN (``stage-<i>.safetensors``),
from the stage's first rank."""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

import dmuon
from service.job.job import Job
from service.job.models.build import compile_blocks, init_rule, prepare_on_meta
from service.job.models.builtin import causal_lm_loss, vocab_parallel
from service.job.models.dtypes import DTYPES, muon_kwargs
from service.job.models.experts import is_expert, use_expert_parallel
from service.job.models.stages import split_stages
from service.job.models.tp_plans import apply_tp
from service.job.spec import JobSpec

from . import checkpoints, layout_events, training_recipe
from .batches import Batches
from .data_parallel import DataParallel
from .mesh import JobMesh, device
from .nonfinite_steps import NonfiniteSteps
from .rank_records import keep_record
from .step_metrics import flops_per_token, ledger_bytes, peak_flops, step_record
from .weights import load_weights

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
             "interleaved": "ScheduleInterleaved1F1B"}


@dataclasses.dataclass
class Pipeline:
    """This rank's stages (``dmuon.PipelineStage``), the optimizer over them, the
    schedule, and each stage's layers ``[lo, hi)`` by stage index (a string: a record's
    JSON key)."""

    stages: list
    opt: dmuon.PipelineMuon
    schedule: object
    layers: dict
    split: object

    @property
    def modules(self) -> list:
        return [s.submod for s in self.stages]


def stage_runs(plan) -> list[list[int]]:
    """The stored split: each stage's ``[lo, hi)``, stage by stage."""
    if not plan.pipeline or not plan.pipeline.get("stages"):
        raise ValueError("layout.pp > 1: the plan stores no stage split (plan it again)")
    return [list(s["layers"]) for s in sorted(plan.pipeline["stages"],
                                              key=lambda s: s["stage"])]


def _dedicate(module, model, spec: JobSpec, mesh: JobMesh, split, source, modes: dict,
              ep: int):
    """DMuon over the stage's data-parallel mesh (its experts cut over the EP group
    first), then FSDP2 per block and on the stage; materialised; its ledger."""
    hsdp = mesh.layout.dp_replicate_enabled
    ep_group = None
    if ep > 1:
        ep_group = dmuon.shard_experts(
            module, lambda n, p: split.predicate(n) and is_expert(n, p), mesh["shard"], ep)
    dmuon.dedicate_stage(module, mesh["shard"], split.selected,
                         replicate_mesh=mesh["replicate"] if hsdp else None,
                         reshard_after_forward=modes["dmuon"] == "z3",
                         hook_boundary_predicate=split.boundary_predicate(model),
                         param_policy=split.param_policy)
    policy = training_recipe.mp_policy(spec)
    fsdp = {"mesh": mesh["replicate", "shard"] if hsdp else mesh["shard"],
            "reshard_after_forward": modes["fsdp"] == "z3",
            **({"mp_policy": policy} if policy is not None else {})}
    names = {n for n, _ in module.named_modules()}
    for fqn in split.fsdp_units:
        if fqn in names:
            dmuon.fully_shard(module.get_submodule(fqn), **fsdp)
    dmuon.fully_shard(module, **fsdp)
    dmuon.materialize(module, seed=spec.seed, init_fn=init_rule(source, model))
    use_expert_parallel(module, ep_group, dmuon.get_ledger(module))
    module.train()


def _io(spec: JobSpec, model, module, rows: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage's static input and output (torch's shape inference would run it
    outside the schedule): token ids or hidden states in (under TP this rank's 1/tp of
    the sequence), hidden states or logits out (the whole, the head's DTensor's)."""
    policy = training_recipe.mp_policy(spec)
    dtype = policy.param_dtype if policy is not None and policy.param_dtype is not None \
        else DTYPES[spec.precision.master_dtype]
    embed = model.model.embed_tokens
    dev, seq = device(), spec.seq_len
    act = torch.empty(rows, seq // tp, embed.embedding_dim, dtype=dtype, device=dev,
                      requires_grad=True)
    inp = torch.zeros(rows, seq, dtype=torch.long, device=dev) if module.first else act
    out = torch.empty(rows, seq, model.lm_head.out_features, dtype=dtype, device=dev) \
        if module.last else act
    return inp, out


def build_pipeline(spec: JobSpec, mesh: JobMesh, source, plan, modes: dict) -> Pipeline:
    """This rank's stages of the stored split, dedicated, under the stored layout's
    schedule, and the ``PipelineMuon`` over them."""
    from torch.distributed import pipelining

    lay = plan.layout
    prepared = prepare_on_meta(spec, source, DTYPES[spec.precision.master_dtype])
    model, split = prepared.model, prepared.split
    if lay.tp_enabled:  # the whole model's plan, then its stages: TP first, as torchtitan
        apply_tp(model, mesh["tp"])
    compile_blocks(spec, model, prepared.blocks)
    count = lay.pp * lay.pp_stages_per_rank
    modules = split_stages(model, count, lay.pp, stage_runs(plan), lay.tp)
    p = mesh["pp"].get_local_rank()
    stages = []
    for index in range(p, count, lay.pp):
        module = modules[index]
        _dedicate(module, model, spec, mesh, split, source, modes, lay.ep)
        if source.weights:  # the stage's own keys: it holds them under the model's FQNs
            load_weights(module, source.weights)
        inp, out = _io(spec, model, module, lay.rows_per_micro, lay.tp)
        stages.append(dmuon.PipelineStage(module, index, count, device(), input_args=inp,
                                          output_args=out, group=mesh["pp"].get_group()))
    opt = dmuon.PipelineMuon(stages, **muon_kwargs(spec.optimizer))
    cls = getattr(pipelining, SCHEDULES[lay.pp_schedule])
    schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=lay.micro_batches,
                   loss_fn=causal_lm_loss)
    return Pipeline(stages, opt, schedule,
                    {str(s.stage_index): list(s.submod.layer_range) for s in stages}, split)


def _run_schedule(pipe: Pipeline, batches: Batches, index: int, dp: DataParallel,
                  batch: tuple[int, int], run) -> list:
    """Batch ``index``'s ``m`` micro-batches of this rank through ``run`` (the schedule's
    ``step``, or ``eval``: forward only); the last stage's micro-batch losses."""
    micros, per_rank = batch
    rows = torch.cat([dp.rows(batches, index, per_rank, i, micros)
                      for i in range(micros)]).to(device())
    losses: list = []
    kwargs = {"target": rows[:, 1:], "losses": losses} \
        if any(s.is_last for s in pipe.stages) else {}
    args = (rows[:, :-1],) if any(s.is_first for s in pipe.stages) else ()
    with vocab_parallel(dp.tp):  # the last stage's loss, and its backward, on TP shards
        run(*args, **kwargs)
    return losses


@torch.no_grad()
def pipeline_validation(pipe: Pipeline, spec: JobSpec, batches: Batches, dp: DataParallel,
                        batch: tuple[int, int]) -> float:
    """The mean loss of ``val_batches`` batches split as a step's, forward only through
    the schedule (``eval``), over the data-parallel ranks: a non-PP job's
    ``validation_loss`` of the same rows (collective over the pipeline)."""
    total = 0.0
    for i in range(spec.data.val_batches):
        total += pipe.opt.step_loss(_run_schedule(pipe, batches, i, dp, batch,
                                                  pipe.schedule.eval))
    return total / spec.data.val_batches


def pipeline_step(pipe: Pipeline, spec: JobSpec, batches: Batches, step: int,
                  dp: DataParallel, batch: tuple[int, int]) -> tuple[float, float | None]:
    """One optimizer step: this rank's ``m`` micro-batches through the schedule; returns
    (the step's loss, the same on every rank; the grad norm over the pipeline)."""
    losses = _run_schedule(pipe, batches, step, dp, batch, pipe.schedule.step)
    norm = None
    if spec.clip_grad_norm is not None:
        norm = pipe.opt.clip_grad_norm_(spec.clip_grad_norm).item()
    pipe.opt.step()
    pipe.opt.zero_grad()
    return pipe.opt.step_loss(losses), norm


def _throughput(pipe: Pipeline, spec: JobSpec, lay, dp: DataParallel):
    """(tokens per rank, tokens per step, FLOPs per token of this rank's stages, peak)."""
    micros, rows = lay.batch
    per_rank = micros * rows * spec.seq_len
    flops = 0.0
    for s in pipe.stages:
        lo, hi = s.submod.layer_range
        hidden = s.submod.config.hidden_size if hasattr(s.submod.config, "hidden_size") \
            else s.submod.config.dim
        flops += flops_per_token(s.submod, hi - lo, hidden, spec.seq_len) / lay.tp
    return per_rank, dp.tokens(per_rank), flops, peak_flops(spec.metrics.peak_tflops,
                                                               device())


def _add_other_stages(record: dict, pipe: Pipeline) -> None:
    """A rank holding v > 1 stages (interleaved): its record's bytes and resident memory
    are its stages' together, as are its packed buffers' peaks (each stage's own peak:
    their sum bounds the rank's, exact under Z2, where every buffer stays)."""
    for module, opt in zip(pipe.modules[1:], pipe.opt.optimizers[1:]):
        for key, n in ledger_bytes(module).items():
            record["bytes"][key] = record["bytes"].get(key, 0) + n
        for kind, n in dmuon.memory_report(module, opt).items():
            record["memory"][kind] += n
        peak, more = record["peak_memory"], dmuon.get_state(module).take_packed_peak()
        if peak["packed_buffers"] is not None and more is not None:
            peak["packed_buffers"] += more


def run_pipeline(job: Job, mesh: JobMesh, report, context, modes: dict):
    """``loop.run_training`` for a pipeline-parallel plan; returns the ``Pipeline``."""
    from service.job.plan_document import partition_digest

    spec, inputs, lay = job.spec, job.inputs, job.plan.layout
    progress = context.progress
    progress.update(phase="setup", step=None)
    pipe = build_pipeline(spec, mesh, inputs["model"], job.plan, modes)
    digests = {str(s.stage_index): partition_digest(dmuon.get_plan(s.submod).to_dict())
               for s in pipe.stages}
    ran = mesh.ran(dmuon.get_plan(pipe.modules[0]).ep_size, lay.batch)
    dp = DataParallel.of(mesh.device_mesh)
    train, val = (Batches(inputs["data"], part, spec.seq_len, spec.seed,
                          spec.data.val_fraction) for part in ("train", "val"))
    tokens, global_tokens, flops_token, peak = _throughput(pipe, spec, lay, dp)
    base_lrs = [g["lr"] for g in pipe.opt.param_groups]
    start = checkpoints.resume(pipe.modules, pipe.opt, job.checkpoint_dir,
                               inputs.get("resume_from"))
    nonfinite = NonfiniteSteps(spec.max_nonfinite_steps, start)
    rank = dist.get_rank()
    event = layout_events.start_event(job.job_dir, list(lay.mesh_shape), start) \
        if job.job_dir and rank == 0 else None
    fixed = dict(coord=mesh.coordinates(), layout=list(lay.mesh_shape),
                 ran_layout=dataclasses.asdict(ran), resumed_from=start,
                 partition_digest=digests[str(pipe.stages[0].stage_index)], stage_digests=digests,
                 stage_layers=pipe.layers, schedule=type(pipe.schedule).__name__,
                 node_id=context.node_ids[rank] if context.node_ids else None,
                 node_ip=context.node_ip)
    if job.export_only:  # the newest checkpoint's stages, written again
        return _export_only(pipe, job, mesh, start, progress)
    for step in range(start, spec.steps):
        progress.update(phase="step", step=step + 1)
        t0 = time.perf_counter()
        lrs = training_recipe.apply_lr(pipe.opt, base_lrs,
                                       training_recipe.lr_factor(spec, step))
        loss, norm = pipeline_step(pipe, spec, train, step, dp, lay.batch)
        record = step_record(pipe.modules[0], pipe.opt.optimizers[0], step=step + 1,
                             loss=loss, elapsed=time.perf_counter() - t0, tokens=tokens,
                             global_tokens=global_tokens, flops_token=flops_token,
                             peak=peak, lr=lrs, grad_norm=norm)
        _add_other_stages(record, pipe)
        record.update(fixed, layout_event=event)
        event = None
        nonfinite.after_step(pipe.opt, record, step + 1)
        if spec.data.val_every and (step + 1) % spec.data.val_every == 0:
            record["val_loss"] = pipeline_validation(pipe, spec, val, dp, lay.batch)
        keep_record(job.job_dir, record)
        path = None
        if job.checkpoint_dir and checkpoints.due(spec, step + 1):
            path = nonfinite.last_good = checkpoints.save(
                spec, job.checkpoint_dir, step + 1, pipe.modules, pipe.opt)
        report(record, path)
        nonfinite.check()
    progress.update(phase="export", step=None)
    if job.export_dir and spec.export.enabled:
        export_stages(pipe, spec, mesh, job.export_dir)
    return pipe


def _export_only(pipe: Pipeline, job: Job, mesh: JobMesh, start: int, progress: dict):
    if start == 0:
        raise RuntimeError(f"nothing to export: no committed checkpoint in "
                           f"{job.checkpoint_dir}")
    progress.update(phase="export")
    export_stages(pipe, job.spec, mesh, job.export_dir)
    return pipe


def export_stages(pipe: Pipeline, spec: JobSpec, mesh: JobMesh, out_dir: str) -> list[str]:
    """Each stage's weights in full, by FQN, in ``stage-<i>.safetensors`` (written by
    the stage's first rank; collective over each stage): together the whole model's."""
    from safetensors.torch import save_file

    dtype = DTYPES[spec.export.dtype or spec.precision.master_dtype]
    first = mesh["replicate"].get_local_rank() == 0 and mesh["shard"].get_local_rank() == 0
    written = []
    for s in pipe.stages:
        full = dmuon.full_state_dict(s.submod)
        if first:
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"stage-{s.stage_index}.safetensors")
            save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in full.items()},
                      path)
            written.append(path)
    dist.barrier()
    return written
