"""``dedicate_params``: give every Muon-target matrix one owner, lay each hook boundary's
matrices out in one packed buffer, and install the hooks.

DMuon issues its collectives on process groups of its own (same members as the mesh's):
its gradient reduces follow an order of their own (see ``reduce.py``), which must never
interleave with FSDP2's collectives on a shared communicator, and on NCCL separate
communicators let DMuon's traffic overlap FSDP2's.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .buffers import Boundary, Member
from .fqn import canonical_fqn, params_by_name
from .hooks import BoundaryHooks
from .partition import DedicationPlan, partition
from .reduce import GradientReduce

_STATE_ATTR = "_dmuon_state"
_DEDICATED_ATTR = "_dmuon_dedicated"


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


def _groups_like(group, copies: int) -> list:
    """``copies`` new groups with ``group``'s members. ``new_group`` is collective over
    the world, so every rank creates every row's groups, in one order."""
    mine = tuple(dist.get_process_group_ranks(group))
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    out = []
    for _ in range(copies):
        for row in sorted(set(rows)):
            new = dist.new_group(list(row))
            if row == mine:
                out.append(new)
    return out


def _mesh_device(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _rank_context(mesh, replicate_mesh, reduce_dtype) -> RankContext:
    if mesh.ndim != 1:
        raise ValueError(
            f"dedicate_params got a {mesh.ndim}-D mesh {mesh.mesh_dim_names} without "
            "replicate_mesh; for HSDP pass mesh=hsdp['shard'], replicate_mesh=hsdp['replicate']"
        )
    if replicate_mesh is not None and replicate_mesh.ndim != 1:
        raise ValueError("replicate_mesh must be a 1-D mesh (the 'replicate' dim of the HSDP mesh)")
    device = _mesh_device(mesh)
    shard_group, reduce_group = _groups_like(mesh.get_group(), 2)
    r = replicate_mesh
    replicate_group, presence_group = _groups_like(r.get_group(), 2) if r is not None \
        else (None, None)
    return RankContext(
        device, shard_group, reduce_group, mesh.get_local_rank(), mesh.size(),
        replicate_group, presence_group, r.get_local_rank() if r is not None else 0,
        r.size() if r is not None else 1, comm.Ledger(), comm.Streams(device), reduce_dtype,
    )


class DMuonState:
    """Everything ``dedicate_params`` attaches to a model (one per model)."""

    def __init__(self, plan: DedicationPlan, ctx: RankContext, reshard_after_forward: bool,
                 prefetch: int):
        self.plan, self.ctx = plan, ctx
        self.reshard_after_forward = reshard_after_forward
        self.prefetch_depth = prefetch
        self.boundaries: list[Boundary] = []  # forward order
        self.hooks: list[BoundaryHooks] = []
        self.reduce: GradientReduce | None = None
        self.in_backward = False
        self.needs_init = False
        self.mp_policy = None
        self.optimizer_attached = False
        self.memory_trace: list[tuple[str, int]] | None = None
        self.model = lambda: None  # a weak reference to the dedicated model, once attached
        self.set_up_checked = False  # before_first_forward ran

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
        for b in self.boundaries:
            b.free()
        self.set_up_checked = True

    def prefetch(self, hooks: BoundaryHooks, forward: bool) -> None:
        """Issue the all-gathers of the next boundaries (in backward: the previous ones,
        Z3 only), so they overlap this boundary's compute. Every rank issues the same."""
        if forward == self.in_backward or not (forward or self.reshard_after_forward):
            return
        self._gather_ahead(self.hooks.index(hooks), forward)

    def _gather_ahead(self, i: int, forward: bool) -> None:
        """The all-gathers of the ``prefetch_depth`` boundaries after position ``i`` in
        forward order (before it, in the backward)."""
        step = 1 if forward else -1
        for k in range(1, self.prefetch_depth + 1):
            j = i + step * k
            if 0 <= j < len(self.boundaries):
                self.boundaries[j].start_gather("forward" if forward else "backward")

    # -- the root's hooks: where one iteration's backward begins and ends -----------------
    def install_root_hooks(self, model: nn.Module) -> None:
        def pre_forward(module, args):
            self.before_first_forward()
            if self.in_backward:
                self.end_backward()
            # the first boundaries' all-gathers overlap what runs before them (the
            # embedding, FSDP2's own gathers); every rank issues them here, in order
            self._gather_ahead(-1, forward=True)

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
                    self._gather_ahead(len(self.boundaries), forward=False)
            return output

        model.register_forward_pre_hook(pre_forward)
        model.register_forward_hook(post_forward)

    def _backward_begins(self, grad):
        if self.in_backward and self.reduce.backward_open:
            return grad  # another output of the same forward
        self.in_backward = True
        self.reduce.begin_backward()
        return grad

    def end_backward(self) -> None:
        self.in_backward = False
        self.reduce.end_backward()
        for h in self.hooks:
            h.reset()

    def adopt_mp_policy(self, policy) -> None:
        """FSDP2's policy, handed over by ``dmuon.fully_shard``: one policy per model."""
        if self.mp_policy is not None:
            if self.mp_policy != policy:
                raise ValueError(f"fully_shard(mp_policy={policy}) differs from DMuon's "
                                 f"{self.mp_policy}: one policy per dedicated model")
            return
        if self.optimizer_attached or self.ledger.steps_closed or self.ledger.current():
            raise RuntimeError("a mixed-precision policy must be set before the first "
                               "forward and before dmuon.Muon is created")
        self.mp_policy = policy
        self.ctx.reduce_dtype = policy.reduce_dtype
        for b in self.boundaries:
            b.set_param_dtype(policy.param_dtype or b.master_dtype)

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
            b.discard_gradients(set_to_none)
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
        finite = [g.sum().isfinite() for g in self.fsdp2_gradients()]
        return (~torch.stack(finite).all()).float() if finite else None

    def after_step(self, replicate_async: bool) -> None:
        for b in self.boundaries:
            b.wait_gather()
            if self.reshard_after_forward:
                b.free()  # a prefetched boundary that did not run this iteration
            b.publish()
            b.start_replicate()
        if not replicate_async:
            self.drain()

    def drain(self) -> None:
        """Wait for pending replicate all-gathers (before anything reads column values)."""
        for b in self.boundaries:
            b.wait_replicate()


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


def _policy(mp_policy, compute_dtype):
    if compute_dtype is None:
        return mp_policy
    if mp_policy is not None:
        raise ValueError("dedicate_params takes mp_policy or compute_dtype, not both "
                         "(compute_dtype=X is mp_policy=MixedPrecisionPolicy(param_dtype=X))")
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype)


def get_state(model: nn.Module) -> DMuonState:
    state = getattr(model, _STATE_ATTR, None)
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


def is_dedicated(param: nn.Parameter) -> bool:
    return bool(getattr(param, _DEDICATED_ATTR, False))


def ignored_params(model: nn.Module) -> set[nn.Parameter]:
    """The dedicated params under ``model``, for ``fully_shard(..., ignored_params=...)``."""
    return {p for p in model.parameters() if is_dedicated(p)}


def _check_not_fully_sharded(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise RuntimeError(
                f"fully_shard was applied to '{name or '<root>'}' before "
                "dmuon.dedicate_params; call dedicate_params first so FSDP2 leaves the "
                "Muon-target params to DMuon (order: TP, dedicate_params, fully_shard)"
            )


def _local_shapes(plan: DedicationPlan, params: dict) -> dict[str, torch.Size]:
    """Each unit's shape as this rank computes with it (a TP shard's local shape)."""
    out = {}
    for unit, a in plan.params.items():
        p = params[a.param]
        shape = p._local_tensor.shape if hasattr(p, "_local_tensor") else p.shape
        out[unit] = torch.Size((a.experts[1] - a.experts[0], *shape[1:])) if a.experts \
            else shape
    return out


def _members(plan: DedicationPlan, params: dict, shapes: dict) -> dict[str, list[Member]]:
    out: dict[str, list[Member]] = {}
    for index, (unit, a) in enumerate(plan.params.items()):
        out.setdefault(a.boundary, []).append(
            Member(unit, params[a.param], a.owner_coord, index, shapes[unit],
                   experts=a.experts))
    return out


def _param_dtype(members: list[Member], mp_policy) -> tuple[torch.dtype, torch.dtype]:
    dtypes = {m.param.dtype for m in members}
    if len(dtypes) != 1:
        raise ValueError(f"hook boundary params have mixed dtypes {sorted(map(str, dtypes))}")
    master = dtypes.pop()
    param_dtype = getattr(mp_policy, "param_dtype", None) or master
    return param_dtype, master


def _refuse_tp_on_meta(model: nn.Module, fqns) -> None:
    for fqn in fqns:
        p = model.get_parameter(fqn)
        if p.is_meta and hasattr(p, "placements"):
            raise NotImplementedError(
                f"'{fqn}' is a tensor-parallel param on the meta device: meta-device init "
                "with tensor parallelism is not supported yet; materialise before TP")


def leave_meta(state: DMuonState) -> None:
    """Dedicated params still on the meta device get a storage-less tensor on the mesh's
    device as their content, keeping their identity (``swap_tensors``: the boundaries,
    the marks and the user's references stay valid; only autograd's hooks, which live on
    the content, are registered again)."""
    for b in state.boundaries:
        swapped = False
        for p in b.params:
            if not p.is_meta:
                continue
            marks = dict(p.__dict__)
            torch.utils.swap_tensors(p, nn.Parameter(
                torch.empty(0, dtype=p.dtype, device=state.ctx.device),
                requires_grad=p.requires_grad))
            p.__dict__.update(marks)
            swapped = True
        if swapped:
            next(h for h in state.hooks if h.boundary is b).hook_gradients()


def build_boundaries(state: DMuonState, params: dict, shapes: dict, policy) -> None:
    """Packed buffers for every boundary, filled with the params' current values
    (unless on the meta device), the module's tensors then viewing them.

    A model that had its values keeps the placeholders' storage until the first forward
    (no more memory than the model held before), a meta model its meta params until
    ``dmuon.materialize``: a ``fully_shard`` bound before ``import dmuon`` then shards a
    copy, or meta tensors, leaving DMuon's storage untouched, and ``check_dedicated``
    names the param instead of a storage-size error."""
    state.boundaries = []
    for name, members in _members(state.plan, params, shapes).items():
        b = Boundary(name, members, state.ctx, *_param_dtype(members, policy))
        if b.on_meta:
            b.free()  # the module keeps its meta params until dmuon.materialize
        else:
            b.load_initial_values()
            b.bind_views()
        state.boundaries.append(b)


def dedicate_params(
    model: nn.Module,
    mesh,
    predicate,
    *,
    replicate_mesh=None,
    reshard_after_forward: bool = True,
    hook_boundary_predicate=None,
    hook_boundary_strict: bool = True,
    mp_policy=None,
    compute_dtype: torch.dtype | None = None,
    prefetch: int = 1,
) -> DedicationPlan:
    """Assign each Muon-target matrix an owner and install DMuon's hooks; returns the plan.

    ``mp_policy`` (FSDP2's ``MixedPrecisionPolicy``, or set by ``dmuon.fully_shard``):
    packed buffers and gathers in ``param_dtype``, reduces in ``reduce_dtype``, masters
    and momentum in the params' own dtype. ``prefetch``: how many boundaries ahead the
    forward (and, in Z3, the backward) issues all-gathers. A model on the meta device is
    planned and laid out without values; ``dmuon.materialize`` then creates them.
    ``compute_dtype`` (the reference's name) is ``mp_policy=MixedPrecisionPolicy(
    param_dtype=compute_dtype)``. The plan returned is also a read-only mapping from each
    dedicated ``nn.Parameter`` to its owner's global rank.
    """
    if hasattr(model, _STATE_ATTR):
        raise RuntimeError("dedicate_params was already called on this model")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    _check_not_fully_sharded(model)
    mp_policy = _policy(mp_policy, compute_dtype)
    plan = partition(
        model, predicate=predicate, shard_size=mesh.size(),
        replicate_size=replicate_mesh.size() if replicate_mesh is not None else 1,
        hook_boundary_predicate=hook_boundary_predicate,
        hook_boundary_strict=hook_boundary_strict,
    )
    ctx = _rank_context(mesh, replicate_mesh, getattr(mp_policy, "reduce_dtype", None))
    state = DMuonState(plan, ctx, reshard_after_forward, prefetch)
    state.mp_policy = mp_policy
    needs_init = any(model.get_parameter(f).is_meta for f in plan.param_fqns)
    shapes = _local_shapes(plan, dict(model.named_parameters()))
    _refuse_tp_on_meta(model, plan.param_fqns)
    build_boundaries(state, dict(model.named_parameters()), shapes, mp_policy)
    state.needs_init = needs_init
    _attach(model, state)
    return plan


def _attach(model: nn.Module, state: DMuonState) -> None:
    """Hooks, the ordered reduce, the marks on dedicated params and the state-dict guard."""
    from .state_dict import install_state_dict_guard

    plan, params = state.plan, dict(model.named_parameters())
    state.hooks = [BoundaryHooks(b, model.get_submodule(b.name), state) for b in state.boundaries]
    state.reduce = GradientReduce(state.boundaries, state.ctx, len(plan.params))
    state.install_root_hooks(model)
    for b in state.boundaries:
        for m in b.members:
            if m.tp is not None:
                plan.params[m.fqn] = dataclasses.replace(plan.params[m.fqn], tp=m.tp.mode)
    for fqn in plan.param_fqns:
        setattr(params[fqn], _DEDICATED_ATTR, fqn)  # truthy, and names it in errors
        params[fqn]._dmuon_owner_state = state  # param groups find the state
    install_state_dict_guard(model, plan)
    state.model = weakref.ref(model)
    _discarding_zero_grad(model, state)
    plan.bind(params)
    setattr(model, _STATE_ATTR, state)


def _discarding_zero_grad(model: nn.Module, state: DMuonState) -> None:
    """``model.zero_grad()`` drops DMuon's gradients too: a dedicated param's gradient
    has left its ``.grad`` for DMuon's buffers by then, where ``nn.Module.zero_grad``
    cannot see it. Set on the instance, so FSDP2's class swap keeps it."""

    def zero_grad(set_to_none: bool = True) -> None:
        state.discard_gradients(set_to_none)
        type(model).zero_grad(model, set_to_none)

    model.zero_grad = zero_grad
