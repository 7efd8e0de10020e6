"""Tensor parallelism in the planner's predictions: what each of the T ranks of a
tensor-parallel group holds and moves, read off the model's TP plan
(``service.job.models.tp_plans.tp_plan``, applied by the workers with ``parallelize_module``) on
the meta model's global shapes.

- **Shards.** ``ColwiseParallel`` splits a Linear's weight (and bias) on dim 0 and an
  Embedding's on dim 1, ``RowwiseParallel`` a Linear's weight on dim 1 and an Embedding's
  on dim 0; every other param (sequence-parallel norms, whole experts) is whole on every
  TP rank. DMuon's owners, packed buffers and momentum and FSDP2's shards of a split
  param hold 1/T of it (the partition itself is made on global shapes, the same for
  every tp column: ``partition_digest`` does not change with T).
- **Newton-Schulz** over TP shards (``dmuon.tp``): a matrix split along its longer (or
  equal) dim all-reduces its m x m Gram matrix, m the unsplit dim, once per Gram
  computation (twice with the restart), in the Gram's dtype; one split along its shorter
  dim (k/v under grouped-query attention) is all-gathered in the update's (master) dtype.
- **Activations.** Every placement change a style makes moves bytes on the ``tp`` dim
  as ``dmuon.tp_traffic`` counts them: ``Shard -> Replicate`` all-gathers (its gradient,
  a ``Partial`` one, is reduce-scattered back), ``Partial -> Shard`` reduce-scatters (its
  gradient is all-gathered), ``Partial -> Replicate`` all-reduces. Under torchtitan's
  sequence-parallel layout that is per block, forward: the attention's and the MLP's
  inputs all-gathered, o_proj's and down_proj's outputs reduce-scattered; backward the
  same four the other way; under activation checkpointing the forward's four again
  (``recompute``). Once per micro-batch outside the blocks: the embedding's output
  reduce-scattered and the head's input all-gathered; its logits stay sharded on the
  vocabulary (loss parallel, ``service.job.models.tp_plans``), so each TP rank holds 1/T of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from fractions import Fraction

from torch import nn

from dmuon.planning import DedicationPlan, mode_of, ns_bytes, peer_ns_flops

_OP = {("partial", "replicate"): ("all_reduce", 2), ("partial", "shard"): ("reduce_scatter", 1),
       ("shard", "replicate"): ("all_gather", 1)}


def _matches(pattern: str, fqn: str) -> bool:
    """``parallelize_module``'s rule: one ``fnmatch`` per dotted atom."""
    atoms, names = pattern.split("."), fqn.split(".")
    return len(atoms) == len(names) and all(fnmatch(n, a) for a, n in zip(atoms, names))


def styled_modules(model: nn.Module, plan: dict) -> list[tuple[str, nn.Module, object]]:
    """(module FQN, module, style) for every module a plan entry reaches, in model order."""
    return [(name, module, style) for name, module in model.named_modules() if name
            for pattern, style in plan.items() if _matches(pattern, name)]


def split_dims(model: nn.Module, plan: dict) -> dict[str, int]:
    """``{param FQN: the dim its TP shard splits}`` for each param the plan splits."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for name, module, style in styled_modules(model, plan):
        colwise, rowwise = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
        if not (colwise or rowwise):
            continue
        linear = isinstance(module, nn.Linear)
        for pname, _ in module.named_parameters(recurse=False):
            if pname == "bias" and rowwise:
                continue  # a rowwise bias is replicated
            out[f"{name}.{pname}"] = (0 if colwise else 1) if linear else (1 if colwise else 0)
    return out


def local_shape(shape: tuple[int, ...], dim: int | None, T: int) -> tuple[int, ...]:
    """A param's TP shard's shape (the whole shape when ``dim`` is None)."""
    if dim is None or T == 1:
        return tuple(shape)
    return tuple(d // T if i == dim else d for i, d in enumerate(shape))


def annotate(plan: DedicationPlan, splits: dict[str, int], T: int) -> None:
    """Mark the stored partition as ``dedicate_params`` does under TP: ``tp_size`` and
    each split matrix's NS rule (its shapes, owners and digest stay global)."""
    if T == 1:
        return
    plan.tp_size = T
    for unit, a in plan.params.items():
        if a.param in splits and len(a.shape) == 2:
            plan.params[unit] = replace(a, tp=mode_of(a.shape, splits[a.param]))


def local_plan(plan: DedicationPlan, splits: dict[str, int], T: int) -> DedicationPlan:
    """The partition as one TP rank holds it: each split unit at 1/T of its elements
    (its TP shard's shape) and its peer's NS FLOPs; ``dmuon.cost``'s formulas then give
    that rank's bytes."""
    if T == 1:
        return plan
    local = DedicationPlan(plan.shard_size, plan.replicate_size, tp_size=T,
                           ep_size=plan.ep_size)
    for unit, a in plan.params.items():
        dim = splits.get(a.param) if len(a.shape) == 2 else None
        shape = local_shape(a.shape, dim, T)
        local.params[unit] = replace(
            a, shape=shape, numel=math.prod(shape),
            ns_flops=a.ns_flops if dim is None else peer_ns_flops(a.shape, dim, T))
    return local


def gram_bytes(plan: DedicationPlan, slot: int, T: int, *, gram_elt: int,
               master_elt: int, steps: int) -> Fraction:
    """The ``tp`` bytes of NS over TP shards for the matrices slot ``slot`` owns (each of
    its T ranks sends them), phase ``step``; ``plan``: the stored (global, annotated)
    partition."""
    return sum((ns_bytes(a.tp, a.shape, T, gram_elt=gram_elt, master_elt=master_elt,
                         steps=steps)
                for a in plan.params.values() if a.owner == slot and a.tp is not None),
               Fraction(0))


@dataclass
class Conversion:
    """One placement change a style makes per forward: its collective, the width of
    the ``[rows, seq, width]`` activation it moves, and whether it repeats under
    activation checkpointing (a block's)."""

    forward: str | None
    backward: str | None
    width: int
    in_block: bool
    output: bool = False  # a module's output (else an input) converted
    block_output: bool = False  # the last conversion of a block's forward, its output


def _kind(placement) -> str:
    return "partial" if placement.is_partial() else \
        "shard" if placement.is_shard() else "replicate"


_REPLICATE, _PARTIAL = ("replicate", None), ("partial", None)


def _p(placement) -> tuple[str, int | None]:
    """A placement as (kind, dim of a [rows, seq, width] activation)."""
    kind = _kind(placement)
    return (kind, placement.dim % 3 if kind == "shard" else None)


def _collective(src, dst) -> str | None:
    if src[0] == dst[0] == "shard" and src[1] != dst[1]:
        return "all_to_all"
    return _OP.get((src[0], dst[0]), (None,))[0]


def _change(src, dst, width: int, in_block: bool, grad, output: bool = False) -> Conversion:
    """``src -> dst`` forward; backward, the gradient (arriving as ``grad``, None: none)
    goes back to ``src`` (to Replicate when ``src`` was Partial)."""
    back = None
    if grad is not None:
        back = _collective(grad, _REPLICATE if src == _PARTIAL else src)
    return Conversion(_collective(src, dst), back, width, in_block, output)


def _linear_style(module, style, in_block: bool, input_prepared: bool) -> list[Conversion]:
    """Colwise/Rowwise on a Linear or an Embedding: input to the layout the matmul wants
    (a replicated input's gradient comes back Partial), output to the style's layout
    (its gradient arrives in that layout). ``input_prepared``: the input is the DTensor
    its parent's ``PrepareModuleInput`` made, taken as it is (no conversion here)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    colwise = isinstance(style, ColwiseParallel)
    embedding = isinstance(module, nn.Embedding)
    out_width = module.embedding_dim if embedding else module.out_features
    out = []
    if not embedding and not input_prepared:  # an embedding's input: token ids
        wanted = _REPLICATE if colwise else ("shard", 2)
        grad = _PARTIAL if wanted == _REPLICATE else wanted
        out.append(_change(_p(style.input_layouts[0]), wanted, module.in_features, in_block,
                           grad))
    produced = ("shard", 2) if colwise else _PARTIAL
    out.append(_change(produced, _p(style.output_layouts[0]), out_width, in_block,
                       _p(style.output_layouts[0]), output=True))
    return out


def _prepared(style, hidden: int, in_block: bool) -> list[Conversion]:
    """PrepareModuleInput/Output(/InputOutput) on a block's attention or MLP: the hidden
    activation converted in and out."""
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
    )

    if isinstance(style, PrepareModuleInputOutput):
        return (_prepared(style.prepare_module_input, hidden, in_block)
                + _prepared(style.prepare_module_output, hidden, in_block))
    out = []
    if isinstance(style, PrepareModuleInput):
        pairs = list(zip(style.input_layouts or (), style.desired_input_layouts or ()))
        pairs += [(style.input_kwarg_layouts[k], style.desired_input_kwarg_layouts[k])
                  for k in style.input_kwarg_layouts]
        for src, dst in pairs:
            if src is None or dst is None:
                continue
            src, dst = _p(src), _p(dst)
            kept = dst == _REPLICATE and not style.use_local_output  # fed to sharded matmuls
            out.append(_change(src, dst, hidden, in_block, _PARTIAL if kept else dst))
    elif isinstance(style, PrepareModuleOutput):
        for src, dst in zip(style.output_layouts, style.desired_output_layouts):
            if src is not None and dst is not None:
                out.append(_change(_p(src), _p(dst), hidden, in_block, _p(dst), output=True))
    return out


def _keeps_dtensor_input(style) -> bool:
    """A style that hands its module the converted input as a DTensor (which the
    module's own colwise projections then take as it is)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    if isinstance(style, PrepareModuleInputOutput):
        style = style.prepare_module_input
    return isinstance(style, PrepareModuleInput) and not style.use_local_output


def conversions(model: nn.Module, plan: dict, blocks: list[str],
                hidden: int) -> list[Conversion]:
    """Every placement change the plan's styles make in one forward (and its gradient's
    in the backward), in model order; sequence-parallel norms make none."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styled = styled_modules(model, plan)
    keeps = {name for name, _, style in styled if _keeps_dtensor_input(style)}
    out, last = [], {}
    for name, module, style in styled:
        block = next((b for b in blocks if name == b or name.startswith(b + ".")), None)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            made = _linear_style(module, style, block is not None,
                                 name.rpartition(".")[0] in keeps)
        else:
            made = _prepared(style, hidden, block is not None)
        made = [c for c in made if c.forward or c.backward]
        out += made
        if block is not None and made:
            last[block] = made[-1]
    for c in last.values():
        c.block_output = c.output and c.forward is not None
    return out


def _recomputed(c: Conversion, checkpointing: str) -> bool:
    """Whether activation checkpointing runs a conversion's forward again in the
    backward: a block's, all of them when reentrant; non-reentrant stops recomputing
    after the block's last saved tensor (``torch.utils.checkpoint``'s early stop), so
    its final output conversion (down_proj's reduce-scatter), which saves none, is not."""
    if checkpointing == "none" or not c.in_block:
        return False
    return checkpointing == "reentrant" or not c.block_output


def activation_traffic(convs: list[Conversion], *, tokens: int, elt: int, T: int,
                       checkpointing: str = "none") -> dict[str, Fraction]:
    """``{phase: bytes}`` on the ``tp`` dim for one micro-batch of ``tokens`` tokens per
    rank: each conversion's collective on its ``[rows, seq, width]`` activation, the
    ledger's ``k (T-1)/T x S`` (k = 2 for an all-reduce, else 1); ``checkpointing``:
    the spec's ``activation_checkpointing``."""
    factor = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}
    out = {"forward": Fraction(0), "backward": Fraction(0), "recompute": Fraction(0)}
    for c in convs:
        size = Fraction(T - 1, T) * tokens * c.width * elt
        if c.forward:
            out["forward"] += factor[c.forward] * size
            if _recomputed(c, checkpointing):
                out["recompute"] += factor[c.forward] * size
        if c.backward:
            out["backward"] += factor[c.backward] * size
    return {k: v for k, v in out.items() if v}


def logits_split(model: nn.Module, plan: dict, vocab: int, T: int) -> int:
    """What divides the logits a TP rank holds: T when the head's style leaves them
    sharded on the vocabulary (loss parallel, as ``service.job.models.tp_plans`` plans the head),
    1 when it all-gathers them (a ``Replicate`` output)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    for _, module, style in styled_modules(model, plan):
        if isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear) and \
                module.out_features == vocab:
            return T if _p(style.output_layouts[0])[0] == "shard" else 1
    return 1


@dataclass
class TPView:
    """The model under a TP degree: which params are split, the activation conversions,
    and what divides the logits each rank holds."""

    T: int
    splits: dict[str, int]
    convs: list[Conversion]
    logits_split: int = 1

    def local_shapes(self, model: nn.Module, names: list[str]) -> list[tuple[int, ...]]:
        params = dict(model.named_parameters())
        return [local_shape(tuple(params[n].shape), self.splits.get(n), self.T) for n in names]


def tp_view(model: nn.Module, T: int, blocks: list[str], hidden: int, vocab: int) -> TPView:
    """The model's TP plan read at degree ``T`` (T = 1: nothing split). ValueError, as
    ``service.job.models.tp_plans.check_tp_degree`` words it, for a degree the model refuses."""
    from ..models.tp_plans import check_tp_degree, tp_plan

    if T == 1:
        return TPView(1, {}, [])
    check_tp_degree(model, T)
    plan = tp_plan(model)
    return TPView(T, split_dims(model, plan), conversions(model, plan, blocks, hidden),
                  logits_split(model, plan, vocab, T))
