"""``train_loop_per_worker`` for ``ray.train.torch.TorchTrainer``, and the training loop
it runs on a built mesh: build on meta, DMuon then FSDP2, materialise (or load the
weights), then per step the LR schedule, accumulation under ``no_sync``, global
clipping, the optimizer step, validation, checkpoints, and at the end the export."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import dmuon
from service.job import failure
from service.job.job import Job
from service.job.models.build import compile_blocks, init_rule, logits_of, prepare_on_meta
from service.job.models.builtin import causal_lm_loss, vocab_parallel
from service.job.models.dtypes import DTYPES, muon_kwargs
from service.job.models.experts import is_expert, use_expert_parallel
from service.job.models.source import BUILTIN
from service.job.models.tp_plans import apply_tp
from service.job.plan_document import PlanDocument, partition_digest
from service.job.spec import JobSpec

from . import checkpoints, layout_events, training_recipe
from .batches import Batches
from .capacity import CapacityWatch, ray_capacity
from .data_parallel import DataParallel
from .export import export
from .mesh import JobMesh, build_mesh, device, node_ids_from_ray
from .nonfinite_steps import NonfiniteSteps
from .pipeline_run import run_pipeline
from .rank_records import keep_record
from .step_metrics import flops_per_token, peak_flops, step_record
from .weights import load_weights

BUILTIN_INPUTS = {"model": BUILTIN, "data": {"kind": "builtin"}}


def run_modes(spec: JobSpec, plan: PlanDocument | None, modes: dict | None) -> dict:
    """``{"dmuon": "z2"|"z3", "fsdp": ...}``: the plan's (which decided ``auto``), else
    the given ones, else the spec's, FSDP2 mirroring DMuon unless the spec sets it apart."""
    if plan is not None and plan.modes is not None:
        return {"dmuon": plan.modes.dmuon, "fsdp": plan.modes.fsdp}
    if modes is None:
        if spec.dmuon.mode == "auto":
            raise ValueError("dmuon.mode: auto is decided by the planner; run the plan")
        modes = {"dmuon": spec.dmuon.mode, "fsdp": spec.dmuon.fsdp_mode(spec.dmuon.mode)}
    return modes


def _degrees(spec: JobSpec, plan: PlanDocument | None) -> tuple[int, int]:
    """(T, P): the plan's layout's; without a plan (tests, benchmarks) the spec's, which
    must then be numbers (``auto`` is the planner's to decide)."""
    if plan is not None:
        return plan.layout.tp, plan.layout.ep
    lay = spec.layout
    if "auto" in (lay.tp, lay.ep):
        raise ValueError("layout.tp or layout.ep: auto is decided by the planner; run "
                         "the plan")
    return lay.tp, lay.ep


def build_training(spec: JobSpec, mesh: DeviceMesh | JobMesh, inputs: dict | None = None,
                   modes: dict | None = None, plan: PlanDocument | None = None):
    """(model, optimizer, param split): built on the meta device, DMuon (on the plan's
    partition, when there is a plan) then FSDP2 per block and on the root; each rank
    materialises only what it keeps."""
    inputs = inputs or BUILTIN_INPUTS
    modes = run_modes(spec, plan, modes)
    tp, ep = _degrees(spec, plan)
    prepared = prepare_on_meta(spec, inputs["model"], DTYPES[spec.precision.master_dtype])
    model, split = prepared.model, prepared.split
    if tp > 1:
        if inputs["model"].weights:
            raise ValueError("model.weights with layout.tp > 1: loading weights into "
                             "tensor-parallel shards is not supported yet")
        apply_tp(model, mesh["tp"])  # TP first, as torchtitan orders it
    compile_blocks(spec, model, prepared.blocks)
    ep_group = _split_experts(inputs["model"], model, split, mesh, ep)
    hsdp = mesh["replicate"].size() > 1
    policy = training_recipe.mp_policy(spec)
    dmuon.dedicate_params(model, mesh["shard"], predicate=split.selected,
                          replicate_mesh=mesh["replicate"] if hsdp else None,
                          reshard_after_forward=modes["dmuon"] == "z3",
                          hook_boundary_predicate=split.boundary_predicate(model),
                          plan=plan.partition if plan is not None else None,
                          param_policy=split.param_policy)
    fsdp = {"mesh": mesh["replicate", "shard"] if hsdp else mesh["shard"],
            "reshard_after_forward": modes["fsdp"] == "z3",
            **({"mp_policy": policy} if policy is not None else {})}
    for fqn in split.fsdp_units:
        dmuon.fully_shard(model.get_submodule(fqn), **fsdp)
    dmuon.fully_shard(model, **fsdp)
    dmuon.materialize(model, seed=spec.seed, init_fn=init_rule(inputs["model"], model))
    if inputs["model"].weights:
        load_weights(model, inputs["model"].weights)
    # at EP 1 too: the experts' grouped evaluation replaces Hugging Face's eager loop
    use_expert_parallel(model, ep_group, dmuon.get_ledger(model))
    model.train()
    opt = dmuon.Muon(model, **muon_kwargs(spec.optimizer))
    return model, opt, split


def _split_experts(source, model, split, mesh, ep: int):
    """This rank's EP group after cutting each MoE layer to its E/P experts (the plan's
    EP degree), or None at EP 1."""
    if ep == 1:
        return None
    if source.weights:
        raise ValueError("model.weights with layout.ep > 1: loading weights into "
                         "expert-parallel shards is not supported yet")
    return dmuon.shard_experts(model, lambda n, p: split.predicate(n) and is_expert(n, p),
                               mesh["shard"], ep)


@torch.no_grad()
def validation_loss(model, spec: JobSpec, batches: Batches, dp: DataParallel,
                    split: tuple[int, int]) -> float:
    """The mean loss of ``val_batches`` batches shaped as a training step's (``split``:
    micro-batches, rows per rank), so every layout scores the same rows; averaged over
    the data-parallel ranks (collective)."""
    total = torch.zeros((), dtype=torch.float64, device=device())
    micros, per_rank = split
    for i in range(spec.data.val_batches):
        for m in range(micros):
            rows = dp.rows(batches, i, per_rank, m, micros).to(device())
            with vocab_parallel(dp.tp):
                total += causal_lm_loss(logits_of(model, rows[:, :-1]), rows[:, 1:]).double()
    return dp.mean(total / (micros * spec.data.val_batches))


def train_step(model, opt, spec: JobSpec, batches: Batches, step: int, dp: DataParallel,
               split: tuple[int, int]) -> tuple[float, float | None]:
    """One optimizer step over ``split[0]`` micro-batches of ``split[1]`` rows per rank;
    returns (this rank's loss, grad norm)."""
    loss = torch.zeros((), dtype=torch.float64, device=device())
    micros, per_rank = split
    for i in range(micros):
        rows = dp.rows(batches, step, per_rank, i, micros).to(device())
        skip_sync = i < micros - 1
        with dmuon.no_sync(model) if skip_sync else contextlib.nullcontext(), \
                vocab_parallel(dp.tp):
            micro_loss = causal_lm_loss(logits_of(model, rows[:, :-1]), rows[:, 1:]) / micros
            micro_loss.backward()
        loss += micro_loss.detach().double()
    norm = None
    if spec.clip_grad_norm is not None:
        norm = dmuon.clip_grad_norm_(model, spec.clip_grad_norm).item()
    opt.step()
    opt.zero_grad()
    return loss.item(), norm


def _throughput(model, spec: JobSpec, split, layout, dp: DataParallel):
    """(tokens per rank, tokens per step, FLOPs per token on this rank, peak FLOP/s). The
    T ranks of a tensor-parallel group share their tokens' FLOPs: each does 1/T."""
    blocks = len(split.fsdp_units)
    hidden = next((m.embedding_dim for m in model.modules()
                   if isinstance(m, torch.nn.Embedding)), 0)
    micros, rows = layout.batch
    per_rank = micros * rows * spec.seq_len
    return (per_rank, dp.tokens(per_rank),
            flops_per_token(model, blocks, hidden, spec.seq_len) / layout.tp,
            peak_flops(spec.metrics.peak_tflops, device()))


@dataclasses.dataclass
class WorkerContext:
    """Where this worker runs, beside the job: ``progress`` always holds the phase and
    the 1-based step in progress (a failure names them); ``node_ids``/``node_ip`` go into
    the records; ``capacity`` (an elastic job) says when Ray Train could start a larger
    planned layout."""

    progress: dict = dataclasses.field(default_factory=dict)
    node_ids: list | None = None
    node_ip: str | None = None
    capacity: CapacityWatch | None = None


def run_training(job: Job, mesh: JobMesh | DeviceMesh, report,
                 context: WorkerContext | None = None):
    """The training loop on a built mesh; returns the model. ``report(record, path)``
    gets every step's record and, on checkpoint steps, the committed directory. With
    ``job.job_dir``, each rank keeps its records there and rank 0 logs this start's
    layout event there. With ``context.capacity``, a step after which a larger planned
    layout could start is checkpointed. A bare ``DeviceMesh`` (tests) must have the
    plan's layout's dims and sizes; a pipeline-parallel plan runs ``run_pipeline``."""
    spec, inputs, lay = job.spec, job.inputs or BUILTIN_INPUTS, job.plan.layout
    mesh = mesh if isinstance(mesh, JobMesh) else JobMesh.around(lay, mesh)
    context = context or WorkerContext()
    if lay.pp_enabled:  # the stored stage split, under torch's schedule
        return run_pipeline(dataclasses.replace(job, inputs=inputs), mesh, report, context,
                            run_modes(spec, job.plan, None))
    progress, checkpoint_dir = context.progress, job.checkpoint_dir
    progress.update(phase="setup", step=None)
    model, opt, split = build_training(spec, mesh, inputs, None, job.plan)
    run = dmuon.get_plan(model)  # the partition run: its digest and EP group reported
    digest, ran = partition_digest(run.to_dict()), mesh.ran(run.ep_size, lay.batch)
    rank, coord, layout = dist.get_rank(), mesh.coordinates(), list(lay.mesh_shape)
    dp, data = DataParallel.of(mesh.device_mesh), inputs["data"]
    train, val = (Batches(data, part, spec.seq_len, spec.seed, spec.data.val_fraction)
                  for part in ("train", "val"))
    tokens, global_tokens, flops_token, peak = _throughput(model, spec, split, lay, dp)
    base_lrs = [g["lr"] for g in opt.param_groups]
    start = checkpoints.resume(model, opt, checkpoint_dir, inputs.get("resume_from"))
    nonfinite = NonfiniteSteps(spec.max_nonfinite_steps, start)
    event = layout_events.start_event(job.job_dir, layout, start) \
        if job.job_dir and rank == 0 else None
    if job.export_only:
        return _export_only(model, spec, inputs["model"], mesh, job.export_dir,
                            (start, checkpoint_dir), progress)
    for step in range(start, spec.steps):
        progress.update(phase="step", step=step + 1)  # numbered as the records are
        t0 = time.perf_counter()
        lrs = training_recipe.apply_lr(opt, base_lrs, training_recipe.lr_factor(spec, step))
        loss, norm = train_step(model, opt, spec, train, step, dp, lay.batch)
        record = step_record(model, opt, step=step + 1, loss=loss,
                             elapsed=time.perf_counter() - t0, tokens=tokens,
                             global_tokens=global_tokens, flops_token=flops_token,
                             peak=peak, lr=lrs, grad_norm=norm)
        record.update(coord=coord, layout=layout, ran_layout=dataclasses.asdict(ran),
                      resumed_from=start, partition_digest=digest, layout_event=event,
                      node_id=context.node_ids[rank] if context.node_ids else None,
                      node_ip=context.node_ip)
        event = None
        nonfinite.after_step(opt, record, step + 1)
        grow = False
        if context.capacity is not None:
            record["capacity"], grow = context.capacity.poll()
        if spec.data.val_every and (step + 1) % spec.data.val_every == 0:
            record["val_loss"] = validation_loss(model, spec, val, dp, lay.batch)
        keep_record(job.job_dir, record)  # before the checkpoint and the report
        path = None
        if checkpoint_dir and (grow or checkpoints.due(spec, step + 1)):
            path = nonfinite.last_good = checkpoints.save(
                spec, checkpoint_dir, step + 1, model, opt)
        report(record, path)
        nonfinite.check()
    return _export_at_end(model, spec, inputs["model"], mesh, job.export_dir, progress)


def _export_at_end(model, spec: JobSpec, source, mesh: JobMesh, out_dir, progress: dict):
    progress.update(phase="export", step=None)
    if out_dir and spec.export.enabled:
        export_model(model, spec, source, mesh, out_dir)
    return model


def _export_only(model, spec: JobSpec, source, mesh: JobMesh, out_dir: str,
                 resumed: tuple[int, str | None], progress: dict):
    progress.update(phase="export")
    if resumed[0] == 0:
        raise RuntimeError(f"nothing to export: no committed checkpoint in {resumed[1]}")
    export_model(model, spec, source, mesh, out_dir)
    return model


def export_model(model, spec: JobSpec, source, mesh: JobMesh, out_dir: str) -> str:
    from .export_config import config_writer

    dtype = DTYPES[spec.export.dtype or spec.precision.master_dtype]
    return export(model, mesh, out_dir, dtype=dtype,
                  write_config=config_writer(spec, source, model))


def _quiet_reports() -> None:
    """Ray Train (2.60) logs each ``ray.train.report`` with its whole metrics
    dict at INFO, from a logger named by its file's path, which ``LoggingConfig``'s level
    (for the ``ray.train`` loggers) does not reach: that logger alone gets WARNING. The
    controller's ``step_line`` says the same once per step. ``dedicate_params``' INFO
    summary (the reference's, for scripts) likewise: the job's stored plan shows the
    assignment (API, dashboard), where every worker would print it again."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)
    logging.getLogger("dmuon.dedicate").setLevel(logging.WARNING)


def train_loop_per_worker(config: dict) -> None:
    """A worker's whole run. Its first exception is described (type, message, rank,
    step, frames) in the job's failure file, first writer wins, then re-raised."""
    import ray.train

    _quiet_reports()
    progress: dict = {"phase": "setup", "step": None}
    try:
        _worker(config, progress)
    except Exception as e:
        if config.get("failure_file"):
            failure.record_first(config["failure_file"], failure.describe(
                e, rank=ray.train.get_context().get_world_rank(), step=progress["step"],
                phase=progress["phase"], source="worker"))
        raise


def _worker(config: dict, progress: dict) -> None:
    import ray.train
    import ray.util

    job: Job = config["job"]
    # an elastic job's layout is the one planned for the workers Ray Train started
    world = ray.train.get_context().get_world_size()
    plan = job.plan.for_world(world)
    torch.set_num_threads(int(config.get("threads", 1)))
    mesh = build_mesh(plan.layout, node_ids_from_ray())
    rank = dist.get_rank()
    capacity = None if plan.elastic is None else CapacityWatch(
        ray_capacity(plan.scaling, plan.scaling.num_workers),
        {e.layout.world_size for e in plan.runnable()}, world, device())

    def report(record, path):  # checkpoints stay in checkpoint_dir alone: not Ray's to copy
        ray.train.report(record)

    context = WorkerContext(progress, mesh.node_ids, ray.util.get_node_ip_address(), capacity)
    model = run_training(dataclasses.replace(job, plan=plan), mesh, report, context)
    if config.get("return_params") and not plan.layout.pp_enabled:
        params = dmuon.full_state_dict(model)
        if rank == 0:
            torch.save(params, config["return_params"])
