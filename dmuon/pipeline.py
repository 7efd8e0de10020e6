"""Pipeline parallelism: dedicated stage modules under ``torch.distributed.pipelining``.

A ``pp`` mesh dim, outermost (torchtitan's order: pp, replicate, shard, tp). Each rank
holds one or more stage modules (more than one for interleaved schedules), each
dedicated with ``dedicate_stage`` over the data-parallel sub-mesh of its pp coordinate,
then ``fully_shard``; ``PipelineStage`` wraps each for torch's schedules, and one
``PipelineMuon`` steps every stage's ``dmuon.Muon`` as one optimizer.

torch's ``PipelineStage`` runs one autograd backward per micro-batch. It turns FSDP2's
gradient sync off for all of them and reduces once, after the last; DMuon follows the
schedule's own signal, ``last_backward``: the micro-batches before it sum their
gradients locally (``no_sync``), the last one's backward reduces the sum, overlapping
its own backward, so each boundary is reduced once per step whatever the micro-batch
count. The schedule divides FSDP2's reduced gradients by the micro-batch count
(``scale_grads``: its loss is each micro-batch's mean); DMuon's are divided where they
land.

Decisions that must be global are taken over the pipeline too: whether a step is
skipped for a non-finite gradient (``PipelineMuon.step``), the total norm clipping
scales to (``PipelineMuon.clip_grad_norm_``) and the step's loss, reported from the
last stage (``PipelineMuon.step_loss``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from . import comm, pipeline_state
from .dedicate import _groups_like, dedicate_params
from .grads import check_norm_type, clip_to, squared_norm
from .model_state import _fsdp2_nonfinite, get_state
from .nonfinite import count_nonfinite
from .optim import Muon
from .process_groups import Communicators


def dedicate_stage(stage: nn.Module, mesh, predicate, *, reshard_after_forward: bool = False,
                   **options):
    """``dedicate_params`` for one pipeline stage, over its pp coordinate's sub-mesh (the
    ``shard`` dim; ``replicate_mesh=`` for HSDP). Z2 by default: Z3 would re-gather
    every matrix for each micro-batch's backward. A stage whose params the predicate
    does not select (the embedding alone) is dedicated with no matrix."""
    return dedicate_params(stage, mesh, predicate, reshard_after_forward=reshard_after_forward,
                           allow_empty=True, **options)


def _sent_bytes(ops) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops
               if op.op in (dist.isend, dist.send))


class PipelineStage(pipelining.PipelineStage):
    """torch's ``PipelineStage`` over a dedicated stage module (``dedicate_stage``, then
    ``fully_shard``): DMuon's reduce goes out with the last micro-batch's backward, its
    gradients land divided by the micro-batch count, and the activations and gradients
    it sends are counted on the ledger's ``pp`` dim. Same arguments as torch's; give
    ``input_args`` and ``output_args`` (static shapes): shape inference would run the
    stage's forward and backward outside the schedule, through DMuon's hooks."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device,
                 **kwargs):
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        self.dmuon = get_state(submodule)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict,
                                   last_backward: bool = False):
        if backward_type != "full":  # a weight pass by autograd.grad leaves .grad alone
            raise NotImplementedError(
                "dmuon.PipelineStage runs full backward passes only; zero-bubble schedules "
                "(separate input and weight passes) are not supported")
        self.dmuon.set_gradient_sync(last_backward)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                      last_backward)
        finally:
            self.dmuon.set_gradient_sync(True)

    def scale_grads(self, grad_scale_factor: int) -> None:
        super().scale_grads(grad_scale_factor)
        self.dmuon.reduce.divide_at_landing(grad_scale_factor)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.dmuon.ledger.record_sent(_sent_bytes(ops), "pp", "forward")
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.dmuon.ledger.record_sent(_sent_bytes(ops), "pp", "backward")
        return ops


class PipelineMuon(torch.optim.Optimizer):
    """One optimizer over the stages this rank holds: a ``dmuon.Muon`` per stage
    (``optimizers``, in the order of ``stages``; ``muon_kwargs`` go to each), stepped
    together: every stage's updates are computed, one flag says whether any is not
    finite anywhere in the pipeline, then all are applied or all skipped (the updates
    of every stage here are held until it lands). ``param_groups`` are the stages' own
    group dicts, so one LR scheduler drives them all. Its state is keyed by the whole
    model's FQNs (``state_dict``; ``dmuon.checkpoint.save(path, stage_modules, opt)``),
    so it loads on another pp degree (``dmuon.pipeline_state``).

    Every rank of the pipeline must hold the same number of stages (the schedules'
    rule): each issues the same collectives, in the same order."""

    def __init__(self, stages: list[PipelineStage], **muon_kwargs):
        self.stages = list(stages)
        self.optimizers = [Muon(s.submod, **muon_kwargs) for s in self.stages]
        self.num_stages = self.stages[0].num_stages
        comms = Communicators()  # the step's agreement on a group of DMuon's own
        self._pp_group = _groups_like(self.stages[0].group or dist.group.WORLD, 1, comms,
                                      "pp")[0]
        comms.warm(self.stages[0].dmuon.ctx.device)
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})

    @property
    def _first(self):
        return self.stages[0].dmuon  # every stage of a rank has the same pp coordinate

    def _over_pipeline(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over every rank of the pipeline: this pp coordinate's data-parallel
        (and TP) groups, then the pp group."""
        state = self._first
        for group, dim in state.reduce.agreement.agreement_groups():
            comm.wait(comm.all_reduce_sum(t, group, state.ledger, dim, "step"))
        comm.wait(comm.all_reduce_sum(t, self._pp_group, state.ledger, "pp", "step"))
        return t

    def _agree_nonfinite(self) -> None:
        """Each stage's flags (its layout's agreement, or its FSDP2 shards here when it
        has no matrix) summed over the pipeline; a stage flagged anywhere skips the step
        on every rank of every stage."""
        flags = torch.zeros(self.num_stages, device=self._first.ctx.device)
        for s in self.stages:
            state, local = s.dmuon, _fsdp2_nonfinite(s.submod)
            state.end_backward()
            state.reduce.prepare_step(local)
            if state.reduce.agreement.issued:
                state.reduce.agreement.present()
            flags[s.stage_index] = float(bool(state.nonfinite_ranks()) or
                                         (local is not None and bool(local)))
        flagged = self._over_pipeline(flags).nonzero().flatten().tolist()
        for s in self.stages:
            own = s.dmuon.nonfinite_ranks()
            s.dmuon.reduce.agreement.add_nonfinite(
                [f"stage {i}" for i in flagged if i != s.stage_index or not own])

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("PipelineMuon.step takes no closure: the schedule runs the "
                             "forward and backward")
        self._agree_nonfinite()
        prepared = [o.orthogonalised_updates() for o in self.optimizers]
        anywhere = False
        if not prepared[0][1]:  # the gradients' skip is the same on every stage by now
            local = count_nonfinite(ortho for updates, _ in prepared
                                    for _, ortho, _, _ in updates)
            flag = torch.zeros(1, device=self._first.ctx.device) if local is None \
                else local.reshape(1)
            anywhere = bool(self._over_pipeline(flag).item())
        for o, (updates, skip) in zip(self.optimizers, prepared):
            o.finish_step(updates, skip, agree=lambda _: anywhere)

    @property
    def skipped_steps(self) -> int:
        return self.optimizers[0].skipped_steps

    @property
    def nonfinite_ranks(self) -> list:
        """The last step's flags over every stage here (ranks of a stage, ``stage i``)."""
        return [r for o in self.optimizers for r in o.nonfinite_ranks]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, *, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, eps: float = 1e-6) -> torch.Tensor:
        """``dmuon.clip_grad_norm_`` over the whole pipeline: each stage's squared norm
        (over its layout) summed over the stages; returns the norm before clipping."""
        check_norm_type(norm_type)
        parts = [squared_norm(s.submod) for s in self.stages]
        total = torch.zeros(1, dtype=torch.float64, device=self._first.ctx.device)
        total += sum(sq.to(torch.float64) for sq, _ in parts)
        # each stage's sum is already over its layout: only the pp group adds
        comm.wait(comm.all_reduce_sum(total, self._pp_group, self._first.ledger, "pp", "step"))
        total = total[0].sqrt()
        for _, grads in parts:
            clip_to(grads, total, max_norm, error_if_nonfinite, eps)
        return total

    def state_dict(self) -> dict:
        """This rank's share of every stage's state, ``{"state": {fqn: {name: tensor}},
        "param_groups": [one per kind]}`` (collective: the groups are agreed)."""
        return pipeline_state.optimizer_state(self.stages, self.optimizers)

    def load_state_dict(self, state_dict: dict) -> None:
        """A ``state_dict`` of this same layout back; every key checked first."""
        pipeline_state.load_optimizer_state(self.stages, self.optimizers, state_dict)

    def checkpoint_share(self) -> tuple[dict, dict]:
        """``dmuon.checkpoint``'s ``(model share, optimizer share)`` of the stages here."""
        return pipeline_state.share(self.stages, self.optimizers)

    def load_checkpoint_share(self, state_dict) -> None:
        pipeline_state.load_share(self.stages, self.optimizers, state_dict)

    def checkpoint_model_keys(self) -> set[str]:
        """The model keys of every stage of the pipeline (collective)."""
        return pipeline_state.model_keys(self.stages)

    def step_loss(self, losses: list) -> float:
        """The step's loss, the same on every rank: the mean of the last stage's
        micro-batch losses (the schedule fills ``losses`` there), averaged over the
        data-parallel ranks."""
        t = torch.zeros(2, dtype=torch.float64, device=self._first.ctx.device)
        if any(s.is_last for s in self.stages):
            t[0], t[1] = sum(float(v) for v in losses) / len(losses), 1.0
        self._over_pipeline(t)
        return (t[0] / t[1]).item()
