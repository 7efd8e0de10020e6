"""What ``dedicate_params`` attaches to a model: where this rank sits, its groups, its
boundaries and hooks, and the ordered gradient reduce (``DMuonState``); and the
functions that read it back from a model (``get_state``, ``get_plan``, the dedicated
and owned params)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import comm
from .cuda_graphs import check_no_cuda_graphs
from .fqn import canonical_fqn, params_by_name
from .nonfinite import count_nonfinite
from .partition import DedicationPlan

if TYPE_CHECKING:
    from .buffers import Boundary
    from .hooks import BoundaryHooks
    from .reduce import GradientReduce

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


class DMuonState:
    """Everything ``dedicate_params`` attaches to a model (one per model)."""

    def __init__(self, plan: DedicationPlan, ctx: RankContext, reshard_after_forward: bool,
                 prefetch: int):
        self.plan, self.ctx = plan, ctx
        self.expert_ctx: RankContext | None = None  # expert-parallel boundaries' context
        self.reshard_after_forward = reshard_after_forward
        self.prefetch_depth = prefetch
        self.boundaries: list[Boundary] = []  # forward order
        self._backward_order: list[Boundary] = []
        self.hooks: list[BoundaryHooks] = []
        self.reduce: GradientReduce | None = None
        self.in_backward = False
        self.needs_init = False
        self.mp_policy = None
        self.own_mp_policy = False  # given to dedicate_params: fully_shard's is FSDP2's alone
        self.optimizer_attached = False
        self.memory_trace: list[tuple[str, int]] | None = None
        self.model = lambda: None  # a weak reference to the dedicated model, once attached
        self.set_up_checked = False  # before_first_forward ran
        self.communicators = None  # DMuon's own groups (process_groups.Communicators)

    @property
    def ledger(self) -> comm.Ledger:
        return self.ctx.ledger

    @property
    def owned_params(self) -> dict[str, torch.Tensor]:
        """Unit FQN -> this rank's master copy, for the units this rank owns."""
        return {fqn: t for b in self.boundaries for fqn, t in b.masters.items()}

    def live_packed_bytes(self) -> int:
        return sum(b.live_bytes() for b in self.boundaries)

    def trace(self, event: str) -> None:
        if self.memory_trace is not None:
            self.memory_trace.append((event, self.live_packed_bytes()))

    def check_initialised(self) -> None:
        if self.needs_init:
            raise RuntimeError("the model was dedicated on the meta device: call "
                               "dmuon.materialize(model, ...) before the first forward")

    def check_dedicated(self) -> None:
        """Refuse a model whose dedicated params FSDP2 took over: a ``fully_shard`` bound
        before ``import dmuon`` is FSDP2's own, which does not skip them."""
        model = self.model()
        if model is None:
            return
        now = params_by_name(model)
        for b in self.boundaries:
            for m in b.members:
                fqn = self.plan.params[m.fqn].param
                if now.get(canonical_fqn(fqn)) is not m.param:
                    raise RuntimeError(
                        f"'{fqn}' is dedicated to DMuon, but FSDP2 sharded it: that "
                        "fully_shard was imported before `import dmuon`, so it does not skip "
                        "dedicated params. Import dmuon first (then `from "
                        "torch.distributed.fsdp import fully_shard` skips them), or call "
                        "dmuon.fully_shard, or pass ignored_params=dmuon.ignored_params(model);"
                        " order: TP, dmuon.dedicate_params, fully_shard")

    def before_first_forward(self) -> None:
        """Checks the set-up once, then frees the placeholders' storage, which a model
        dedicated with its values kept until now (see ``build_boundaries``)."""
        if self.set_up_checked:
            return
        self.check_initialised()
        self.check_dedicated()
        check_no_cuda_graphs(((h.name, h.module) for h in self.hooks),
                             self.reshard_after_forward, self.model())
        for b in self.boundaries:
            b.free()
        self.set_up_checked = True

    def prefetch(self, hooks: BoundaryHooks, forward: bool) -> None:
        """Issue the all-gathers of the next boundaries (in backward: the ones its
        backward reaches next, Z3 only), so they overlap this boundary's compute. Every
        rank issues the same."""
        if forward == self.in_backward or not (forward or self.reshard_after_forward):
            return
        order = self.boundaries if forward else self.backward_order()
        self._gather_ahead(order, order.index(hooks.boundary), forward)

    def backward_order(self) -> list[Boundary]:
        """The order the backward enters the boundaries: the reverse of the order their
        forwards end (FSDP2's rule), so a boundary nested in another (experts inside
        their block) comes right after it; without nesting, the reverse forward order."""
        def ends_before(a: str, b: str) -> bool:  # a's forward ends before b's
            return b == "" or a.startswith(b + ".") if a != b else False

        if len(self._backward_order) == len(self.boundaries):
            return self._backward_order
        done: list = []
        for b in self.boundaries:  # forward (pre-)order; parents come before children
            at = len(done)
            while at > 0 and ends_before(b.name, done[at - 1].name):
                at -= 1
            done.insert(at, b)
        self._backward_order = done[::-1]
        return self._backward_order

    def _gather_ahead(self, order: list, i: int, forward: bool) -> None:
        """The all-gathers of the ``prefetch_depth`` boundaries after position ``i`` in
        ``order``."""
        for k in range(1, self.prefetch_depth + 1):
            if 0 <= i + k < len(order):
                order[i + k].transfer.start_gather("forward" if forward else "backward")

    # -- the root's hooks: where one iteration's backward begins and ends -----------------
    def install_root_hooks(self, model: nn.Module) -> None:
        @torch.compiler.disable  # collectives and set-up checks: eager under a compile
        def pre_forward(module, args):
            self.before_first_forward()
            if self.in_backward:
                self.end_backward()
            # the first boundaries' all-gathers overlap what runs before them (the
            # embedding, FSDP2's own gathers); every rank issues them here, in order
            self._gather_ahead(self.boundaries, -1, forward=True)

        def post_forward(module, args, output):
            if torch.is_grad_enabled() and not self.in_backward:
                from torch.utils._pytree import tree_flatten

                hooked = False
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._backward_begins)
                        hooked = True
                if hooked and self.reshard_after_forward:
                    # Z3: the backward needs the last boundaries first; their re-gathers
                    # overlap the loss and the head's backward
                    self._gather_ahead(self.backward_order(), -1, forward=False)
            return output

        model.register_forward_pre_hook(pre_forward)
        model.register_forward_hook(post_forward)

    def _backward_begins(self, grad):
        if self.in_backward and self.reduce.backward_open:
            return grad  # another output of the same forward
        self.in_backward = True
        self.reduce.begin_backward()
        # Boundaries the backward did not end (inputs without grad, a param without a
        # gradient on this rank) end in one callback when the backward is over, on every
        # rank, before anything of the next step: ended at the next forward instead,
        # a rank issued DMuon's reduce after FSDP2's collectives where its peers issued
        # it before them, and NCCL wants one order across communicators (FSDP2 ends its
        # own backward the same way)
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
        return grad

    def _backward_ends(self) -> None:
        if self.in_backward:
            self.end_backward()

    def end_backward(self) -> None:
        if self.in_backward:
            for h in self.hooks:
                h.end_backward()
        self.in_backward = False
        self.reduce.end_backward()
        for h in self.hooks:
            h.reset()

    def adopt_mp_policy(self, policy) -> None:
        """FSDP2's policy, handed over by ``dmuon.fully_shard``: one policy for both kinds
        of params, unless ``dedicate_params`` was given DMuon's own (the reference's
        ``compute_dtype`` beside FSDP2's ``mp_policy``)."""
        if self.own_mp_policy:
            return
        if self.mp_policy is not None:
            if self.mp_policy != policy:
                raise ValueError(f"fully_shard(mp_policy={policy}) differs from DMuon's "
                                 f"{self.mp_policy}: one policy per dedicated model")
            return
        if self.optimizer_attached or self.ledger.steps_closed or self.ledger.current():
            raise RuntimeError("a mixed-precision policy must be set before the first "
                               "forward and before dmuon.Muon is created")
        self.mp_policy = policy
        for ctx in {id(c): c for c in [self.ctx, *(b.ctx for b in self.boundaries)]}.values():
            ctx.reduce_dtype = policy.reduce_dtype
        for b in self.boundaries:
            b.set_param_dtype(policy.param_dtype or b.master_dtype)

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
        self.reduce.prepare_step(self._fsdp2_nonfinite())
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

    def fsdp2_gradients(self) -> list[torch.Tensor]:
        """This rank's FSDP2 gradient shards (local tensors)."""
        model = self.model()
        grads = [p.grad for p in model.parameters() if not is_dedicated(p)
                 and p.grad is not None] if model is not None else []
        return [g.to_local() if hasattr(g, "to_local") else g for g in grads]

    def _fsdp2_nonfinite(self) -> torch.Tensor | None:
        count = count_nonfinite(self.fsdp2_gradients())
        return None if count is None else (count > 0).float()

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


def get_state(model: nn.Module) -> DMuonState:
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
    replicate)`` coordinate. Their values and gradients live in the owner's masters
    (``dmuon.get_state(model).owned_params``); these are the module's params."""
    plan = get_state(model).plan
    if isinstance(rank, tuple):
        shard, replica = rank
        rank = replica * plan.shard_size + shard
    if not (isinstance(rank, int) and not isinstance(rank, bool)
            and 0 <= rank < plan.world_size):
        raise ValueError(f"rank={rank!r} is not a rank of the {plan.world_size}-rank layout")
    return [p for p in get_dedicated_params(model)
            if rank in {plan.params[u].owner for u in plan.param_fqns[p._dmuon_dedicated]}]


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
