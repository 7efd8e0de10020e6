"""Pipeline-parallel training of the built-in model for the core tests: the model split
into stage modules that keep its FQNs, each dedicated over its pp coordinate's shard
sub-mesh, driven by a torch.distributed.pipelining schedule (PP 2 x FSDP 2 on 4 ranks;
the mesh is (pp, [replicate,] shard, [tp]), torchtitan's order, the shard dim whatever
the world leaves)."""

from __future__ import annotations

import torch
from torch import nn

import dmuon
from helpers.model import ModelConfig, build_model, causal_lm_loss, muon_predicate, rope_cos_sin
from helpers.train import HPARAMS, SEQ, global_batches, local_rows, lr_lambda

PP, DP = 2, 2
CONFIG = ModelConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                     ffn_dim=128, max_seq_len=64)
# stage -> (holds the embedding, its layers, holds the norm and head)
SPLITS = {
    "two": [(True, [0, 1], False), (False, [2, 3], True)],
    "four": [(True, [0], False), (False, [1], False), (False, [2], False),
             (False, [3], True)],
    "embedding_alone": [(True, [], False), (False, [0, 1, 2, 3], True)],
}
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def tp_plan():
    """test_tp's plan: the attention and MLP projections split, column then row."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{n: ColwiseParallel() for n in COLWISE}, **{n: RowwiseParallel() for n in ROWWISE}}


def checkpoint_wrapped(layer: nn.Module) -> nn.Module:
    """Activation checkpointing on one layer (torch's wrapper: its FQNs gain a segment
    that state dicts leave out)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(layer)


class StageModule(nn.Module):
    """Some of the built-in model's modules under their original FQNs (``model.layers.2``
    stays ``model.layers.2``), so the reference's state dict compares key by key.
    ``checkpointing``: each layer recomputed in the backward (``torch.utils.checkpoint``,
    non-reentrant), its activations not kept."""

    def __init__(self, full: nn.Module, first: bool, layers: list[int], last: bool,
                 checkpointing: bool = False):
        super().__init__()
        self.config, self.first, self.last = full.config, first, last
        self.checkpointing = checkpointing
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layers})
        if last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        c = self.config
        cos, sin = rope_cos_sin(torch.arange(h.shape[1]), c.head_dim, c.rope_theta, h.dtype)
        for layer in self.model.layers.values():
            if self.checkpointing:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return self.lm_head(self.model.norm(h)) if self.last else h


def make_mesh(pp: int, replicate: int = 1, tp: int = 1):
    """(pp, [replicate,] shard, [tp]) over the world, the shard dim what is left."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shard = dist.get_world_size() // (pp * replicate * tp)
    dims = [("pp", pp), ("replicate", replicate), ("shard", shard), ("tp", tp)]
    dims = [(n, s) for n, s in dims if n in ("pp", "shard") or s > 1]
    return init_device_mesh("cpu", tuple(s for _, s in dims),
                            mesh_dim_names=tuple(n for n, _ in dims))


def _stage(mesh, full, index: int, split: str, z3: bool, micro_rows: int, ac: str | None):
    first, layers, last = SPLITS[split][index]
    module = StageModule(full, first, layers, last, checkpointing=ac == "checkpoint")
    names = mesh.mesh_dim_names
    if "tp" in names:
        from torch.distributed.tensor.parallel import parallelize_module

        for layer in module.model.layers.values():
            parallelize_module(layer, mesh["tp"], tp_plan())
    if ac == "wrapper":
        for key in list(module.model.layers):
            module.model.layers[key] = checkpoint_wrapped(module.model.layers[key])
    hsdp = "replicate" in names
    dmuon.dedicate_stage(module, mesh["shard"], muon_predicate, reshard_after_forward=z3,
                         replicate_mesh=mesh["replicate"] if hsdp else None)
    fsdp_mesh = mesh["replicate", "shard"] if hsdp else mesh["shard"]
    for layer in module.model.layers.values():
        dmuon.fully_shard(layer, mesh=fsdp_mesh, reshard_after_forward=z3)
    dmuon.fully_shard(module, mesh=fsdp_mesh, reshard_after_forward=z3)
    # static shapes; requires_grad marks what carries a gradient between stages
    act = torch.empty(micro_rows, SEQ, CONFIG.dim, dtype=torch.float64, requires_grad=True)
    inp = torch.zeros(micro_rows, SEQ, dtype=torch.long) if first else act
    out = torch.empty(micro_rows, SEQ, CONFIG.vocab_size, dtype=torch.float64) if last else act
    return dmuon.PipelineStage(module, index, len(SPLITS[split]), torch.device("cpu"),
                               input_args=inp, output_args=out, group=mesh["pp"].get_group())


def schedule_for(name: str, stages: list, micro: int, loss_fn):
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
           "interleaved": ScheduleInterleaved1F1B,
           "zero_bubble": ScheduleInterleavedZeroBubble}[name]
    return cls(stages if len(stages) > 1 else stages[0], n_microbatches=micro, loss_fn=loss_fn)


def data_rank(mesh) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel degree): TP peers share rows."""
    names = mesh.mesh_dim_names
    r, R = (mesh["replicate"].get_local_rank(), mesh["replicate"].size()) \
        if "replicate" in names else (0, 1)
    N = mesh["shard"].size()
    return r * N + mesh["shard"].get_local_rank(), R * N


def build(schedule: str, split: str, z3: bool, micro: int, replicate: int = 1,
          global_batch: int = 16, pp: int = PP, tp: int = 1, ac: str | None = None):
    """This rank's stages (interleaved: stage p + pp * k), the PipelineMuon over them and
    the schedule; ``replicate`` > 1: HSDP inside each stage, ``tp`` > 1: TP inside each
    layer; ``ac``: activation checkpointing on each layer (``"checkpoint"``,
    ``"wrapper"``)."""
    mesh = make_mesh(pp, replicate, tp)
    full = build_model(CONFIG, dtype=torch.float64, seed=0)
    p = mesh["pp"].get_local_rank()
    indices = range(p, len(SPLITS[split]), pp)
    rows = global_batch // data_rank(mesh)[1] // micro
    stages = [_stage(mesh, full, i, split, z3, rows, ac) for i in indices]
    opt = dmuon.PipelineMuon(stages, **HPARAMS, ns_dtype=torch.float64)
    loss_fn = lambda out, target: causal_lm_loss(out, target)  # noqa: E731
    return mesh, stages, opt, schedule_for(schedule, stages, micro, loss_fn)


def pp_train(rank, world, *, schedule="1f1b", split="two", z3=False, steps=10, micro=4,
             clip=None, poison=None, replicate=1, pp=PP, tp=1, ac=None, path=None,
             save_at=None, load=False) -> dict:
    """Train; returns the full params of this rank's stages, losses, norms, ledgers.
    ``poison(stages, step)``: a test's hook before each step's schedule runs. ``path``:
    a checkpoint saved after ``save_at`` steps, or (``load``) resumed from."""
    mesh, stages, opt, run = build(schedule, split, z3, micro, replicate, pp=pp, tp=tp, ac=ac)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    d, dp = data_rank(mesh)
    modules = [s.submod for s in stages]
    forwards = _count_layer_forwards(stages)
    out, start = {"losses": [], "norms": [], "skipped": [], "after": []}, 0
    if load:
        extra = dmuon.checkpoint.load(path, modules, opt)
        start = sched.last_epoch = extra["step"]  # the lrs come back in the groups
        out["loaded"] = full_state(stages, opt)
    for step, batch in enumerate(global_batches(steps, CONFIG.vocab_size)):
        if step < start:
            continue
        rows = local_rows(batch, d, dp)
        if poison is not None:
            poison(stages, step)
        losses: list = []
        kwargs = {"target": rows[:, 1:], "losses": losses} \
            if any(s.is_last for s in stages) else {}
        args = (rows[:, :-1],) if any(s.is_first for s in stages) else ()
        run.step(*args, **kwargs)
        if clip is not None:
            out["norms"].append(opt.clip_grad_norm_(clip).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        out["losses"].append(opt.step_loss(losses))
        out["skipped"].append(opt.nonfinite_ranks)
        out["after"].append(full_params(stages))
        if save_at == step + 1:
            dmuon.checkpoint.save(path, modules, opt, extra={"step": step + 1})
            out["saved"] = full_state(stages, opt)
    out["final"], out["layer_forwards"] = full_params(stages), dict(forwards)
    out["ledgers"] = {s.stage_index: dmuon.get_ledger(s.submod).last_step_by_phase()
                      for s in stages}
    return out


def _count_layer_forwards(stages) -> dict:
    """stage index -> how many times its decoder layers ran forward (recomputations in
    the backward included)."""
    from helpers.model import DecoderLayer

    counts = {s.stage_index: 0 for s in stages}
    for s in stages:
        for m in s.submod.modules():
            if isinstance(m, DecoderLayer):
                m.register_forward_pre_hook(
                    lambda *_, i=s.stage_index: counts.__setitem__(i, counts[i] + 1))
    return counts


def full_params(stages) -> dict:
    """Every param of this rank's stages in full, by FQN (collective over each stage)."""
    return {k: v.clone() for s in stages for k, v in dmuon.full_state_dict(s.submod).items()}


def full_state(stages, opt) -> dict:
    """Every param and optimizer state tensor of this rank's stages in full, by FQN
    (``optim/<fqn>/<state>``): what a checkpoint holds of them (collective)."""
    from helpers.train import optimizer_snapshot

    out = full_params(stages)
    for s, o in zip(stages, opt.optimizers):
        out.update({f"optim/{k}": v for k, v in optimizer_snapshot(s.submod, o).items()})
    return out
