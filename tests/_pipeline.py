"""Pipeline-parallel training of the built-in model for the core tests: the model split
into stage modules that keep its FQNs, each dedicated over its pp coordinate's shard
sub-mesh, driven by a torch.distributed.pipelining schedule (PP 2 x FSDP 2 on 4 ranks)."""

from __future__ import annotations

import torch
from _model import ModelConfig, build_model, causal_lm_loss, muon_predicate, rope_cos_sin
from _train import HPARAMS, SEQ, global_batches, local_rows, lr_lambda
from torch import nn

import dmuon

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


class StageModule(nn.Module):
    """Some of the built-in model's modules under their original FQNs (``model.layers.2``
    stays ``model.layers.2``), so the reference's state dict compares key by key."""

    def __init__(self, full: nn.Module, first: bool, layers: list[int], last: bool):
        super().__init__()
        self.config, self.first, self.last = full.config, first, last
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
            h = layer(h, cos, sin)
        return self.lm_head(self.model.norm(h)) if self.last else h


def _stage(mesh, full, index: int, split: str, z3: bool, micro_rows: int):
    first, layers, last = SPLITS[split][index]
    module = StageModule(full, first, layers, last)
    hsdp = "replicate" in mesh.mesh_dim_names
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


def build(schedule: str, split: str, z3: bool, micro: int, replicate: int = 1,
          global_batch: int = 16):
    """This rank's stages (interleaved: stage p + PP * k), the PipelineMuon over them and
    the schedule; ``replicate`` > 1: HSDP inside each stage (pp, replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    dims = ("pp", "replicate", "shard") if replicate > 1 else ("pp", "shard")
    shape = (PP, replicate, DP) if replicate > 1 else (PP, DP)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    full = build_model(CONFIG, dtype=torch.float64, seed=0)
    p = mesh["pp"].get_local_rank()
    indices = range(p, len(SPLITS[split]), PP)
    rows = global_batch // (replicate * DP) // micro
    stages = [_stage(mesh, full, i, split, z3, rows) for i in indices]
    opt = dmuon.PipelineMuon(stages, **HPARAMS, ns_dtype=torch.float64)
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
           "interleaved": ScheduleInterleaved1F1B,
           "zero_bubble": ScheduleInterleavedZeroBubble}[schedule]
    loss_fn = lambda out, target: causal_lm_loss(out, target)  # noqa: E731
    run = cls(stages if len(stages) > 1 else stages[0], n_microbatches=micro, loss_fn=loss_fn)
    return mesh, stages, opt, run


def pp_train(rank, world, *, schedule="1f1b", split="two", z3=False, steps=10, micro=4,
             clip=None, poison=None, replicate=1) -> dict:
    """Train; returns the full params of this rank's stages, losses, norms, ledgers.
    ``poison(stages, step)``: a test's hook before each step's schedule runs."""
    mesh, stages, opt, run = build(schedule, split, z3, micro, replicate)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    r = mesh["replicate"].get_local_rank() if replicate > 1 else 0
    d, dp = r * DP + mesh["shard"].get_local_rank(), replicate * DP
    out = {"losses": [], "norms": [], "skipped": [], "after": []}
    for step, batch in enumerate(global_batches(steps, CONFIG.vocab_size)):
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
    out["final"] = full_params(stages)
    out["ledgers"] = {s.stage_index: dmuon.get_ledger(s.submod).last_step_by_phase()
                      for s in stages}
    return out


def full_params(stages) -> dict:
    """Every param of this rank's stages in full, by FQN (collective over each stage)."""
    return {k: v.clone() for s in stages for k, v in dmuon.full_state_dict(s.submod).items()}
