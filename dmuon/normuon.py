"""NorMuon's row normalisation of an orthogonalised update, at its owner.

NorMuon (Li, Liu, Ma, Li, Zhao, "NorMuon: Making Muon more efficient and scalable",
arXiv 2510.05491; the authors' ``normuon.py``, github.com/zichongli5/NorMuon): after NS,
each row (output neuron) of the update O is divided by the root of a running mean, over
steps, of that row's mean squared entry, v <- beta2 v + (1 - beta2) mean_j O_ij^2,
O_ij / (sqrt(v_i) + eps); the result is then rescaled to the Frobenius norm O had. The
authors' defaults: beta2 = 0.95, eps = 1e-10. A 3-D param's slices (experts) each keep
their own rows and norm.

Under tensor parallelism each peer holds a shard of O: split on rows, every row is whole
on its peer and only the norms span the peers; split on columns, a row's squares are
summed over the TP group first. The statistics are kept in the master's precision.
"""

from __future__ import annotations

import torch

from . import comm

BETA2, EPS = 0.95, 1e-10
ROW_STATE = "second_momentum_buffer"  # the authors' name for v


def second_moment_like(p: torch.Tensor) -> torch.Tensor:
    """The per-row state of a (local) param: one value per row, per expert slice."""
    return torch.zeros(*p.shape[:-1], 1, dtype=p.dtype, device=p.device)


def _tp_sum(t: torch.Tensor, tp, ledger) -> torch.Tensor:
    if tp is not None:
        comm.wait(comm.all_reduce_sum(t, tp.group, ledger, "tp", "step"))
    return t


def _row_squares(X: torch.Tensor, tp, ledger) -> torch.Tensor:
    """Each row's sum of squares; a row split over the TP peers (columns split) is summed
    over them."""
    rows_sq = (X * X).sum(-1, keepdim=True)
    return _tp_sum(rows_sq, tp, ledger) if tp is not None and tp.shard_dim == 1 else rows_sq


def _frobenius(rows_sq: torch.Tensor, tp, ledger) -> torch.Tensor:
    """||X|| per slice from its rows' sums of squares (summed over TP where the peers
    hold different rows)."""
    total = rows_sq.sum(dim=(-2, -1), keepdim=True)
    return (_tp_sum(total, tp, ledger) if tp is not None and tp.shard_dim == 0
            else total).sqrt()


def normalise_rows(ortho: torch.Tensor, second_moment: torch.Tensor, beta2: float, *,
                   tp=None, ledger=None) -> torch.Tensor:
    """NorMuon's update from NS's ``ortho`` (this peer's shard under TP); updates
    ``second_moment`` in place."""
    update = ortho.to(second_moment.dtype)
    rows_sq = _row_squares(update, tp, ledger)
    cols = tp.full_shape[1] if tp is not None else update.shape[-1]
    second_moment.lerp_(rows_sq / cols, 1 - beta2)
    normalised = update / (second_moment.sqrt() + EPS)
    new_norm = _frobenius(_row_squares(normalised, tp, ledger), tp, ledger)
    return normalised * (_frobenius(rows_sq, tp, ledger) / (new_norm + EPS))


def normuon_update(state: dict, p: torch.Tensor, ortho: torch.Tensor, group: dict, tp,
                   ledger) -> torch.Tensor:
    """NorMuon's update of NS's output (``state``: the optimizer's state of the param
    ``p``, whose dtype its statistics keep). Called after the step's skip is agreed, so
    a skipped step leaves NorMuon's statistics as they were."""
    if ROW_STATE not in state:
        state[ROW_STATE] = second_moment_like(p)
    return normalise_rows(ortho, state[ROW_STATE], group["beta2"], tp=tp, ledger=ledger)
