"""Dropless token routing for expert parallelism (EP): tokens go to the EP rank that holds
their expert and come back with ``all_to_all_single``, in one place.

The EP group has P ranks; with E experts, EP rank p holds experts [p*E/P, (p+1)*E/P).
``dispatch_combine`` takes this rank's tokens ``[n, hidden]``, their top-k expert
choices ``[n, k]`` and router weights ``[n, k]``, and:

1. orders the n*k (token, choice) rows by expert, hence by the rank holding it;
2. exchanges the row counts per expert (an ``all_to_all_single`` of E int64 counts), so
   each rank knows how many rows each source sends to each of its local experts;
3. sends the rows (``all_to_all_single`` with uneven splits), runs each local expert on
   the rows it received, grouped by local expert, and sends the results back the same
   way;
4. combines them at the source: ``out[t] = sum_j weights[t, j] * expert_j(tokens[t])``.

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

from typing import Callable, Sequence

import torch
import torch.distributed as dist
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


def _run_local_experts(rows: torch.Tensor, from_sources: torch.Tensor,
                       experts: Sequence[Callable]) -> torch.Tensor:
    """Each local expert on its received rows. ``rows`` arrive by source rank, then by
    local expert within a source (``from_sources[src, j]`` rows); the results go back in
    that order."""
    local = torch.arange(from_sources.shape[1], device=rows.device).repeat(from_sources.shape[0])
    expert_of_row = local.repeat_interleave(from_sources.flatten())
    by_expert = torch.argsort(expert_of_row, stable=True)
    chunks = rows[by_expert].split(from_sources.sum(0).tolist())
    if isinstance(experts, nn.Module) and not isinstance(experts, nn.ModuleList):
        outs = experts(list(chunks))  # one call: DMuon's hooks gather its experts once
    else:
        outs = torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)])
    return outs[torch.argsort(by_expert)]


def _check(tokens, choices, weights, num_experts: int, experts, P: int) -> None:
    if num_experts % P:
        raise ValueError(f"num_experts={num_experts} is not divisible by the EP group's "
                         f"{P} ranks")
    grouped = isinstance(experts, nn.Module) and not isinstance(experts, nn.ModuleList)
    if not grouped and len(experts) != num_experts // P:
        raise ValueError(f"experts: {len(experts)} local experts given, the EP rank "
                         f"holds num_experts/P = {num_experts // P}")
    if choices.shape != weights.shape or choices.shape[0] != tokens.shape[0]:
        raise ValueError(f"choices {tuple(choices.shape)} and weights "
                         f"{tuple(weights.shape)} must both be [tokens={tokens.shape[0]}, k]")
    if choices.numel() and not 0 <= int(choices.min()) <= int(choices.max()) < num_experts:
        raise ValueError(f"choices: expert ids must lie in [0, {num_experts})")


# Run eagerly inside a compiled block (one graph break here): the row counts decide the
# splits on the host, and the ledger must count every call, not once at trace time.
@torch.compiler.disable
def dispatch_combine(tokens: torch.Tensor, choices: torch.Tensor, weights: torch.Tensor,
                     experts: Sequence[Callable], num_experts: int, group,
                     ledger: comm.Ledger | None = None) -> torch.Tensor:
    """``[n, hidden]``: each token's experts' outputs weighted by ``weights``, the
    experts running on the EP ranks that hold them (``experts``: this rank's E/P, as a
    sequence of callables, or as one module called once with the list of each local
    expert's rows that returns their outputs concatenated: a hook boundary of its own
    under ``dmuon.shard_experts``)."""
    P = dist.get_world_size(group)
    _check(tokens, choices, weights, num_experts, experts, P)
    n, k = choices.shape
    flat = choices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, so by EP rank
    per_expert = torch.bincount(flat, minlength=num_experts).to(torch.int64)
    from_sources = _counts_from_sources(per_expert, group, ledger)
    send = per_expert.view(P, -1).sum(1).tolist()
    recv = from_sources.sum(1).tolist()
    rows = all_to_all_rows(tokens[order // k], send, recv, group, ledger)
    outs = _run_local_experts(rows, from_sources, experts)
    back = all_to_all_rows(outs, recv, send, group, ledger)
    per_choice = back[torch.argsort(order)].view(n, k, back.shape[-1])
    return (per_choice * weights.unsqueeze(-1).to(per_choice.dtype)).sum(1)
