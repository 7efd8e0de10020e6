"""Dropless token routing for expert parallelism (EP): tokens go to the EP rank that holds
their expert and come back with ``all_to_all_single``, in one place.

The EP group has P ranks; with E experts, EP rank p holds experts [p*E/P, (p+1)*E/P).
``dispatch_combine`` takes this rank's tokens ``[n, hidden]``, their top-k expert
choices ``[n, k]`` and router weights ``[n, k]``, and:

1. orders the n*k (token, choice) rows by expert, hence by the rank holding it;
2. exchanges the row counts per expert (an ``all_to_all_single`` of E int64 counts), so
   each rank knows how many rows each source sends to each of its local experts, and
   copies its counts to the host in one copy: the dispatch's only host sync (on CUDA
   each read drains the stream; splits, group sizes and bounds all derive from it);
3. sends the rows (``all_to_all_single`` with uneven splits), runs the local experts on
   the rows it received, grouped by local expert (``grouped_linear`` computes a layer of
   all of them from the whole 3-D weight), and sends the results back the same way;
4. combines them at the source: ``out[t] = sum_j weights[t, j] * expert_j(tokens[t])``.

With ``group=None`` every expert is local: steps 1, 3 and 4 without the exchanges, the
same one host sync (the model's own MoE at EP 1).

Dropless: no capacity, no dropped row, so the result is the one-process evaluation's.
Every rank issues the same three collectives (two more in the backward) whatever its
routing: an expert or a rank without rows sends and receives zero rows, and a local
expert without rows still runs on an empty ``[0, hidden]`` tensor (its weights get a
zero gradient on every rank alike, never a missing one).

The exchanges are differentiable: the backward of a row all-to-all is the all-to-all
of the gradients with the splits swapped.

Bytes go to the ledger on the ``ep`` mesh dim, in the ledger's bandwidth-optimal model
(``comm`` docstring): an all-to-all whose input on this rank is S bytes counts
(P-1)/P x S for this rank, S being everything this rank puts in, its own rows included.
With routing spread evenly over the experts this is exactly what leaves the rank; with
skewed routing the bytes that actually leave differ, by routing (the model stays what a
planner can predict from tokens x hidden x top_k). Per call: the counts (8E bytes), the
dispatched rows (n*k rows) and the returned rows (the rows this rank received). Phase
``forward``, or ``recompute`` when the forward runs inside a backward (activation
checkpointing re-runs it there); the two gradient all-to-alls count as ``backward``.

Under ``torch.compile`` of the block that calls it, ``dispatch_combine`` runs eagerly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import comm


def _phase_now() -> str:
    """``recompute`` inside a running backward (autograd's engine has a graph task: how
    ``torch.utils.checkpoint`` itself tells), ``forward`` otherwise."""
    return "recompute" if torch._C._current_graph_task_id() != -1 else "forward"


def _record(ledger: comm.Ledger | None, t: torch.Tensor, group, phase: str) -> None:
    if ledger is not None:
        ledger.record("all_to_all", t.numel() * t.element_size(),
                      dist.get_world_size(group), "ep", phase)


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """``x``'s rows, ``send[i]`` of them to group rank i, ``recv[i]`` back from rank i."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """The row exchange, differentiable: the gradient goes back along the same rows."""

    @staticmethod
    def forward(ctx, x, send, recv, group, ledger):
        ctx.send, ctx.recv, ctx.group, ctx.ledger = send, recv, group, ledger
        _record(ledger, x, group, _phase_now())
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        _record(ctx.ledger, grad, ctx.group, "backward")
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int], group,
                    ledger: comm.Ledger | None = None) -> torch.Tensor:
    """Differentiable uneven all-to-all of ``x``'s rows over ``group`` (ledger dim ``ep``)."""
    return _AllToAllRows.apply(x, send, recv, group, ledger)


def _counts_from_sources(per_expert: torch.Tensor, group, ledger) -> torch.Tensor:
    """``[P, E/P]``: rows each source rank sends to each of this rank's local experts,
    from this rank's rows per expert (``[E]``): one all-to-all of E counts."""
    P = dist.get_world_size(group)
    _record(ledger, per_expert, group, _phase_now())
    out = torch.empty_like(per_expert)
    dist.all_to_all_single(out, per_expert, group=group)
    return out.view(P, -1)


class RowGroups(NamedTuple):
    """Rows grouped by local expert, ``sizes[j]`` rows for expert j (host ints), and
    ``ends``, their running sums as ``int32`` on the rows' device (``grouped_mm``'s
    offsets, derived there so that no count travels back to the device)."""

    sizes: list[int]
    ends: torch.Tensor


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` runs these operands: torch 2.13 has kernels for bf16 on
    CUDA sm80+ only, and its operands' strides must be multiples of 16 bytes."""
    return (x.is_cuda and x.dtype == weight.dtype == torch.bfloat16
            and hasattr(F, "grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (8, 0)
            and weight.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """``[m, out]``: the rows of group j times ``weight[j].T`` (``x``: ``[m, in]``
    grouped as ``groups`` says, ``weight``: ``[G, out, in]``), from the whole 3-D weight.

    A select per expert (``weight[j]``) makes its backward write a zero tensor of the
    whole weight per expert and sum them: E x the weight's bytes. ``grouped_mm`` (one
    kernel, one gradient) where it runs, else one ``unbind`` whose backward stacks the
    per-expert gradients once."""
    if grouped_mm_fits(x, weight):
        return F.grouped_mm(x, weight.transpose(-2, -1), offs=groups.ends)
    parts = zip(x.split(groups.sizes), weight.unbind(0))
    return torch.cat([F.linear(rows, w) for rows, w in parts])


def _call_experts(experts, rows: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """The local experts on ``rows`` (grouped by local expert): each callable of a
    sequence on its rows, or one callable on all of them with their groups."""
    if isinstance(experts, (list, tuple, nn.ModuleList)):
        return torch.cat([expert(part) for expert, part in
                          zip(experts, rows.split(groups.sizes))])
    return experts(rows, groups)


def _groups(per_expert: torch.Tensor, sizes: list[int]) -> RowGroups:
    return RowGroups(sizes, per_expert.cumsum(0).to(torch.int32))


def _run_local_experts(rows: torch.Tensor, from_sources: torch.Tensor,
                       host: list[int], experts) -> torch.Tensor:
    """Each local expert on its received rows. ``rows`` arrive by source rank, then by
    local expert within a source (``from_sources[src, j]`` rows, ``host`` its values on
    the host); the results go back in that order."""
    P, L = from_sources.shape
    local = torch.arange(L, device=rows.device).repeat(P)
    expert_of_row = local.repeat_interleave(from_sources.flatten(), output_size=len(rows))
    by_expert = torch.argsort(expert_of_row, stable=True)
    sizes = [sum(host[src * L + j] for src in range(P)) for j in range(L)]
    outs = _call_experts(experts, rows[by_expert], _groups(from_sources.sum(0), sizes))
    return outs[torch.argsort(by_expert)]


def _check(tokens, choices, weights, num_experts: int, experts, P: int) -> None:
    """Shapes and counts, on the host (the expert ids are checked in ``_to_host``)."""
    if num_experts % P:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP group's "
                         f"{P} ranks")
    if isinstance(experts, (list, tuple, nn.ModuleList)) and len(experts) != num_experts // P:
        raise ValueError(f"experts: {len(experts)} local experts given, the EP rank "
                         f"holds num_experts/P = {num_experts // P}")
    if choices.shape != weights.shape or choices.shape[0] != tokens.shape[0]:
        raise ValueError(f"choices {tuple(choices.shape)} and weights "
                         f"{tuple(weights.shape)} must both be [tokens={tokens.shape[0]}, k]")


def _to_host(num_experts: int, flat: torch.Tensor, *counts: torch.Tensor) -> list[list[int]]:
    """The dispatch's one host sync: ``counts`` and the number of expert ids outside
    [0, E) in one copy; raises on such ids (they were left out of the counts)."""
    bad = ((flat < 0) | (flat >= num_experts)).sum().reshape(1)
    values = torch.cat([bad, *(c.reshape(-1) for c in counts)]).tolist()
    if values[0]:
        raise ValueError(f"choices: expert ids must lie in [0, {num_experts})")
    out, at = [], 1
    for c in counts:
        out.append(values[at:at + c.numel()])
        at += c.numel()
    return out


def _sorted_counts(flat: torch.Tensor, num_experts: int):
    """The (token, choice) rows in expert order, stable, and the rows per expert in
    [0, E): searched in the sorted ids, where ``bincount`` syncs twice on CUDA."""
    ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=ids.dtype)
    return order, torch.searchsorted(ids, bounds).diff()


def _dispatch_over(rows: torch.Tensor, flat: torch.Tensor, per_expert: torch.Tensor,
                   experts, num_experts: int, group, ledger) -> torch.Tensor:
    """The rows' expert outputs, in ``rows``' order, the experts on their EP ranks."""
    P = dist.get_world_size(group)
    from_sources = _counts_from_sources(per_expert, group, ledger)
    mine, theirs = _to_host(num_experts, flat, per_expert, from_sources)
    L = num_experts // P
    send = [sum(mine[p * L:(p + 1) * L]) for p in range(P)]
    recv = [sum(theirs[p * L:(p + 1) * L]) for p in range(P)]
    received = all_to_all_rows(rows, send, recv, group, ledger)
    outs = _run_local_experts(received, from_sources, theirs, experts)
    return all_to_all_rows(outs, recv, send, group, ledger)


# Run eagerly inside a compiled block (one graph break here): the row counts decide the
# splits on the host, and the ledger must count every call, not once at trace time.
@torch.compiler.disable
def dispatch_combine(tokens: torch.Tensor, choices: torch.Tensor, weights: torch.Tensor,
                     experts, num_experts: int, group=None,
                     ledger: comm.Ledger | None = None) -> torch.Tensor:
    """``[n, hidden]``: each token's experts' outputs weighted by ``weights``, the
    experts running on the EP ranks that hold them. ``experts``: this rank's E/P, as a
    sequence of callables each called on its rows, or as one callable called once as
    ``experts(rows, groups)`` with every local row grouped by expert (``RowGroups``),
    returning their outputs in that order (for ``grouped_linear``; a module there is a
    hook boundary of its own under ``dmuon.shard_experts``). ``group=None``: every
    expert is local and nothing is exchanged."""
    P = 1 if group is None else dist.get_world_size(group)
    _check(tokens, choices, weights, num_experts, experts, P)
    n, k = choices.shape
    flat = choices.reshape(-1)
    order, per_expert = _sorted_counts(flat, num_experts)
    rows = tokens[order // k]  # grouped by expert, so by EP rank
    if group is None:
        (sizes,) = _to_host(num_experts, flat, per_expert)
        outs = _call_experts(experts, rows, _groups(per_expert, sizes))
    else:
        outs = _dispatch_over(rows, flat, per_expert, experts, num_experts, group, ledger)
    per_choice = outs[torch.argsort(order)].view(n, k, outs.shape[-1])
    return (per_choice * weights.unsqueeze(-1).to(per_choice.dtype)).sum(1)
