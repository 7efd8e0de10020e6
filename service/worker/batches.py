"""The job's batches: the built-in corpus, a text file (bytes) or token shards, as
windows of ``seq_len + 1`` tokens chosen by a pure function of (seed, step), so a
resumed run sees exactly the batches an uninterrupted one does. Each rank reads only its
own rows of the global batch; token shards stay memory-mapped."""

from __future__ import annotations

import numpy as np
import torch

from service.job.inputs.shards import Shard, TokenWindows, split_part, tokens_of

from .corpus import load_corpus, load_text_corpus

VAL_STREAM = 1  # validation batches draw from seed + 1, apart from training's


def _arrays(data: dict, split: str, val_fraction: float):
    """(arrays, part of each array) of one split."""
    if data["kind"] == "builtin":
        return [load_corpus(split).numpy()], (0.0, 1.0)
    if data["kind"] == "text":
        return [load_text_corpus(data["path"], split, val_fraction).numpy()], (0.0, 1.0)
    if split == "val" and data.get("val"):
        return [tokens_of(Shard(**s)) for s in data["val"]], (0.0, 1.0)
    arrays = [tokens_of(Shard(**s)) for s in data["train"]]
    if data.get("val"):
        return arrays, (0.0, 1.0)
    return arrays, split_part(split, val_fraction)


class Batches:
    """Rows of the global batch of a step for one data-parallel rank."""

    def __init__(self, data: dict, split: str, seq_len: int, seed: int, val_fraction: float):
        arrays, part = _arrays(data, split, val_fraction)
        self.windows = TokenWindows(arrays, seq_len, part)
        self.seed = seed + (VAL_STREAM if split == "val" else 0)
        if self.windows.total == 0:
            raise ValueError(f"no {split} window of {seq_len + 1} tokens in the data")

    def rows(self, step: int, per_rank: int, dp_rank: int, dp_size: int,
             micro: int = 0, micros: int = 1) -> torch.Tensor:
        """Micro-batch ``micro`` of ``dp_rank``: rows ``[(micro x dp_size + dp_rank) x
        per_rank, ... + per_rank)`` of the step's ``micros x dp_size x per_rank`` windows."""
        count = micros * dp_size * per_rank
        lo = (micro * dp_size + dp_rank) * per_rank
        rows = self.windows.rows(step, self.seed, count, lo, lo + per_rank)
        return torch.from_numpy(np.ascontiguousarray(rows))
