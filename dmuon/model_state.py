"""What ``dedicate_params`` attaches to a model: where this rank sits, its groups, its
boundaries and hooks, and the ordered gradient reduce (``DedicatedModel``); and the
functions that read it back from a model (``get_state``, ``get_plan``, the dedicated
and owned params)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .cuda_graphs import check_no_cuda_graphs
from .fqn import canonical_fqn, params_by_name
from .hooks import BoundaryHooks
from .iteration import Iteration
from .nonfinite import count_nonfinite
from .partition import DedicationPlan
from .reduce import GradientReduce

if TYPE_CHECKING:
    from .buffers import Boundary

STATE_ATTR = "_dmuon_state"
DEDICATED_ATTR = "_dmuon_dedicated"


@dataclasses.dataclass
class RankContext:
    """Where this rank sits, the groups DMuon talks on, and how it casts."""

    device: torch.device
    shard_group: object  # parameter all-gathers
    reduce_group: object  # gradient reduce-scatters (same members)
    shard_rank: int
    shard_size: int
    replicate_group: object
    presence_group: object  # the replicate dim again, free of queued reduces at the step
    replicate_rank: int
    replicate_size: int
    ledger: comm.Ledger
    streams: comm.Streams
    reduce_dtype: torch.dtype | None = None
    tp_group: object = None  # the TP peers of dedicated TP shards (their NS talks there)
    # an expert-parallel boundary's context: its shard group is the expert shard group,
    # and ``ep_group`` the EP ranks its layer's experts are spread over
    ep_group: object = None


class DedicatedModel:
    """Everything ``dedicate_params`` attaches to a model (one per model), built once:
    the plan, this rank's contexts and groups, the boundaries (forward order), their
    hooks, the ordered gradient reduce and the iteration's root hooks. Other modules ask
    it; none assigns into it."""

    def __init__(self, model: nn.Module, plan: DedicationPlan, ctx: RankContext,
                 boundaries: list, *, expert_ctx: RankContext | None, communicators,
                 reshard_after_forward: bool, prefetch: int, mp_policy, own_mp_policy: bool,
                 policies: dict | None = None):
        self.plan, self.ctx, self.expert_ctx = plan, ctx, expert_ctx
        self.communicators = communicators  # DMuon's own groups (process_groups)
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch
        self.mp_policy = mp_policy
        # name -> DMuonParamPolicy of each selected param (dmuon.routing); {} without one
        self.policies: dict = dict(policies or {})
        self.own_mp_policy = own_mp_policy  # given to dedicate_params: FSDP2's is its own
        self.boundaries: list[Boundary] = boundaries
        self.needs_init = any(p.is_meta for b in boundaries for p in b.params)
        self.optimizer_attached = False
        self.memory_trace: list[tuple[str, int]] | None = None  # tests set a list
        self.model = weakref.ref(model)
        self._set_up_checked = False  # before_first_forward ran
        self.hooks: list[BoundaryHooks] = [
            BoundaryHooks(b, model.get_submodule(b.name), self) for b in boundaries]
        self.reduce: GradientReduce = GradientReduce(boundaries, ctx, len(plan.params))
        self.iteration = Iteration(self)
        self.iteration.install(model)

    @property
    def ledger(self) -> comm.Ledger:
        return self.ctx.ledger

    @property
    def in_backward(self) -> bool:
        return self.iteration.in_backward

    @property
    def owned_params(self) -> dict[str, torch.Tensor]:
        """Unit FQN -> this rank's master copy, for the units this rank owns."""
        return {fqn: t for b in self.boundaries for fqn, t in b.masters.items()}

    def live_packed_bytes(self) -> int:
        return sum(b.live_bytes() for b in self.boundaries)

    def trace(self, event: str) -> None:
        if self.memory_trace is not None:
            self.memory_trace.append((event, self.live_packed_bytes()))

    def take_packed_peak(self) -> int | None:
        """The most bytes the packed buffers held at once since the last call (None at
        the first call, which starts the trace): a step's Z3 peak, which ``memory_report``
        after the step cannot see."""
        trace, self.memory_trace = self.memory_trace, []
        return max((b for _, b in trace), default=0) if trace is not None else None

    def mark_initialised(self) -> None:
        """``dmuon.materialize`` gave every dedicated param its values."""
        self.needs_init = False

    def attach_optimizer(self) -> None:
        self.optimizer_attached = True

    def before_first_forward(self) -> None:
        """Checks the set-up once, then frees the placeholders' storage, which a model
        dedicated with its values kept until now (see ``build_boundaries``)."""
        if self._set_up_checked:
            return
        if self.needs_init:
            raise RuntimeError("the model was dedicated on the meta device: call "
                               "dmuon.materialize(model, ...) before the first forward")
        check_dedicated(self)
        check_no_cuda_graphs(((h.name, h.module) for h in self.hooks),
                             self.reshard_after_forward, self.model())
        for b in self.boundaries:
            b.free()
        self._set_up_checked = True

    def end_backward(self) -> None:
        self.iteration.end_backward()

    def set_gradient_sync(self, sync: bool) -> None:
        """``no_sync``: whether a backward's gradients are reduced (False: summed here)."""
        self.reduce.sync = sync

    def adopt_mp_policy(self, policy) -> None:
        """FSDP2's policy, handed over by ``dmuon.fully_shard``: one policy for both kinds
        of params, unless ``dedicate_params`` was given DMuon's own (the reference's
        ``compute_dtype`` beside FSDP2's ``mp_policy``)."""
        if self.own_mp_policy or not _is_new_policy(self, policy):
            return
        self.mp_policy = policy
        _retype_buffers(self.ctx, self.boundaries, policy)

    # -- the optimizer's view: what every rank agrees on at the step ---------------------
    def agree(self, flag: torch.Tensor) -> bool:
        """Whether ``flag`` is set on any rank of the layout (every rank calls it)."""
        return self.reduce.agreement.any_rank(flag)

    def nonfinite_ranks(self) -> list:
        """The ranks (or ["fsdp2"]) whose gradients this step were not finite, known once
        the first boundary has landed."""
        return self.reduce.agreement.nonfinite or []

    def data_parallel_groups(self) -> list[tuple]:
        return self.reduce.agreement.data_parallel_groups()

    def finish_gradient_sync(self) -> None:
        """Every gradient reduced and landed on its owner (clipping)."""
        for _ in self.landing_order():
            pass

    def landing_order(self):
        """The boundaries as their gradients land (the reduces' fixed order), each one
        landed before it is yielded, so the owner can work on it while later ones are
        still on the wire."""
        self.end_backward()
        self.reduce.prepare_step(_fsdp2_nonfinite(self.model()))
        for b in reversed(self.boundaries):
            self.reduce.land(b)
            yield b
        self.reduce.close_step()

    def discard_gradients(self, set_to_none: bool = True) -> None:
        """``zero_grad``: the gradients of every backward since the last step are gone,
        whether still local (``no_sync``), on the wire, or landed on an owner."""
        if self.in_backward:
            self.end_backward()
        self.reduce.discard()
        for b in self.boundaries:
            b.grads.discard(set_to_none)
        model = self.model()
        if model is not None:
            _drop_fsdp2_unreduced_gradients(model)

    def after_step(self, replicate_async: bool) -> None:
        for b in self.boundaries:
            b.transfer.wait_gather()
            if self.reshard_after_forward:
                b.free()  # a prefetched boundary that did not run this iteration
            b.publish()
            b.transfer.start_replicate()
        if not replicate_async:
            self.drain()

    def drain(self) -> None:
        """Wait for pending replicate all-gathers (before anything reads column values)."""
        for b in self.boundaries:
            b.transfer.wait_replicate()


def _fsdp2_nonfinite(model: nn.Module | None) -> torch.Tensor | None:
    """Whether this rank's FSDP2 gradient shards hold a NaN or an inf (None: none)."""
    grads = [p.grad for p in model.parameters() if not is_dedicated(p)
             and p.grad is not None] if model is not None else []
    count = count_nonfinite(g.to_local() if hasattr(g, "to_local") else g for g in grads)
    return None if count is None else (count > 0).float()


def check_dedicated(state: DedicatedModel) -> None:
    """Refuse a model whose dedicated params FSDP2 took over: a ``fully_shard`` bound
    before ``import dmuon`` is FSDP2's own, which does not skip them."""
    model = state.model()
    if model is None:
        return
    now = params_by_name(model)
    for b in state.boundaries:
        for m in b.members:
            fqn = state.plan.params[m.fqn].param
            if now.get(canonical_fqn(fqn)) is not m.param:
                raise RuntimeError(
                    f"'{fqn}' is dedicated to DMuon, but FSDP2 sharded it: that "
                    "fully_shard was imported before `import dmuon`, so it does not skip "
                    "dedicated params. Import dmuon first (then `from "
                    "torch.distributed.fsdp import fully_shard` skips them), or call "
                    "dmuon.fully_shard, or pass ignored_params=dmuon.ignored_params(model);"
                    " order: TP, dmuon.dedicate_params, fully_shard")


def _drop_fsdp2_unreduced_gradients(model: nn.Module) -> None:
    """FSDP2 keeps a ``no_sync`` backward's gradients on its unsharded params, which
    ``zero_grad`` never reaches (it sees the sharded ones), so the next synced backward
    would reduce them with its own; FSDP2 has no public call that drops them. Read-only
    use of its param-group state; nothing of FSDP2 is replaced."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(fully_shard.state(module), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


def get_state(model: nn.Module) -> DedicatedModel:
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        raise RuntimeError("model has no DMuon state: call dmuon.dedicate_params(model, ...) first")
    return state


def get_plan(model: nn.Module) -> DedicationPlan:
    """The plan ``dedicate_params`` made for ``model``."""
    return get_state(model).plan


def get_dedicated_params(model: nn.Module) -> list[nn.Parameter]:
    """Every dedicated param of ``model`` (the module's own placeholders), in plan order."""
    now = params_by_name(model)
    return [now[canonical_fqn(fqn)] for fqn in get_state(model).plan.param_fqns]


def get_owned_params(model: nn.Module, rank) -> list[nn.Parameter]:
    """The dedicated params ``rank`` owns: a global rank, or the reference's ``(shard,
    replicate)`` coordinate. Under TP a global rank owns its coordinate's matrices (its
    TP shard of them). Their values and gradients live in the owner's masters
    (``dmuon.get_state(model).owned_params``); these are the module's params."""
    state = get_state(model)
    plan = state.plan
    if isinstance(rank, tuple):
        shard, replica = rank
        rank = replica * plan.shard_size + shard
    elif isinstance(rank, int) and not isinstance(rank, bool) and plan.tp_size > 1:
        rank = _coordinate_of(state.ctx, rank)
    if not (isinstance(rank, int) and not isinstance(rank, bool)
            and 0 <= rank < plan.world_size):
        raise ValueError(f"rank={rank!r} is not a rank of the {plan.world_size}-rank layout")
    return [p for p in get_dedicated_params(model)
            if rank in {plan.params[u].owner for u in plan.param_fqns[p._dmuon_dedicated]}]


def _coordinate_of(ctx: RankContext, rank: int) -> int:
    """Global ``rank``'s (replicate, shard) coordinate index under TP, as this rank knows
    it with no collective: itself and its TP peers, its shard group's ranks, its
    replicate group's."""
    def members(group) -> list[int]:
        return dist.get_process_group_ranks(group) if group is not None else []

    mine = ctx.replicate_rank * ctx.shard_size + ctx.shard_rank
    if rank == dist.get_rank() or rank in members(ctx.tp_group):
        return mine
    shard, replicas = members(ctx.shard_group), members(ctx.replicate_group)
    if rank in shard:
        return mine - ctx.shard_rank + shard.index(rank)
    if rank in replicas:
        return replicas.index(rank) * ctx.shard_size + ctx.shard_rank
    raise ValueError(f"rank={rank}: under TP a rank outside this rank's shard, replicate and "
                     "TP groups is named by its (shard, replicate) coordinate")


def wait_all_reduces(model: nn.Module) -> None:
    """Every gradient reduced and landed in its owner's master ``.grad`` (``step()`` and
    ``clip_grad_norm_`` do this themselves)."""
    get_state(model).finish_gradient_sync()


def wait_all_replicate_broadcasts(model: nn.Module) -> None:
    """HSDP: every replicate all-gather ``step()`` left in flight (``replicate_async``)
    has landed, so each replica holds its owners' new values (on CUDA the current stream
    waits for them). The next forward and every state-dict call wait by themselves."""
    get_state(model).drain()


wait_all_post_step_broadcasts = wait_all_replicate_broadcasts  # the reference's other name


def is_dedicated(param: nn.Parameter) -> bool:
    return bool(getattr(param, DEDICATED_ATTR, False))


def ignored_params(model: nn.Module) -> set[nn.Parameter]:
    """The dedicated params under ``model``, for ``fully_shard(..., ignored_params=...)``."""
    return {p for p in model.parameters() if is_dedicated(p)}


DMuonState = DedicatedModel  # the name before issue 51; get_state's type


def _is_new_policy(state: DedicatedModel, policy) -> bool:
    """Whether FSDP2's ``policy`` is one for ``state`` to adopt: the one it holds is
    not; another, or one that comes after the first forward or the optimizer, is
    refused."""
    if state.mp_policy is not None:
        if state.mp_policy != policy:
            raise ValueError(f"fully_shard(mp_policy={policy}) differs from DMuon's "
                             f"{state.mp_policy}: one policy per dedicated model")
        return False
    if state.optimizer_attached or state.ledger.steps_closed or state.ledger.current():
        raise RuntimeError("a mixed-precision policy must be set before the first "
                           "forward and before dmuon.Muon is created")
    return True


def _retype_buffers(ctx: RankContext, boundaries: list, policy) -> None:
    """The contexts' reduce dtype and the boundaries' buffers in ``policy``'s dtypes."""
    for c in {id(c): c for c in [ctx, *(b.ctx for b in boundaries)]}.values():
        c.reduce_dtype = policy.reduce_dtype
    for b in boundaries:
        b.set_param_dtype(policy.param_dtype or b.master_dtype)
