"""Token shards on disk, read memory-mapped, and a deterministic window sampler.

Formats: a flat ``.bin`` of ``uint16``/``uint32`` token ids, optionally after a
256-int32 header (llm.c's convention, which ``dmuon-svc prepare`` writes: magic,
version, token count; version 1 is ``uint16``, 7 is ``uint32``), or a 1-D ``.npy``
array. Nothing here loads a shard whole: windows are sliced out of ``np.memmap``s, so a
worker's memory does not grow with the data set. numpy only (no torch): the control
plane uses it to check a spec.
"""

from __future__ import annotations

import glob
import os
from dataclasses import asdict, dataclass

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
HEADER_KINDS = {(20240520, 1): "uint16", (20240801, 7): "uint32"}
MAGIC_OF = {dtype: key for key, dtype in HEADER_KINDS.items()}


class ShardError(ValueError):
    """A shard that cannot be read as tokens; the message says which and why."""


@dataclass(frozen=True)
class Shard:
    path: str
    dtype: str
    offset: int  # bytes before the first token
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def describe(path: str, dtype: str | None = None) -> Shard:
    """A shard's dtype, data offset and token count, from its header (or ``dtype``)."""
    if path.endswith(".npy"):
        array = np.load(path, mmap_mode="r")
        if array.ndim != 1 or array.dtype.kind not in "ui":
            raise ShardError(f"{path}: a token .npy is a 1-D integer array, got "
                             f"{array.ndim}-D {array.dtype}")
        return Shard(path, array.dtype.name, array.offset, int(array.shape[0]))
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = np.frombuffer(fh.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"), np.int32)
    kind = HEADER_KINDS.get((int(head[0]), int(head[1])))
    if kind is not None:
        tokens, itemsize = int(head[2]), np.dtype(kind).itemsize
        if HEADER_BYTES + tokens * itemsize != size:
            raise ShardError(f"{path}: header says {tokens} tokens of {kind}, the file has "
                             f"{size - HEADER_BYTES} bytes after it")
        return Shard(path, kind, HEADER_BYTES, tokens)
    if dtype is None:
        raise ShardError(f"{path}: no token header; give the dtype (uint16 or uint32)")
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ShardError(f"{path}: {size} bytes is not a whole number of {dtype} tokens")
    return Shard(path, dtype, 0, size // itemsize)


def tokens_of(shard: Shard) -> np.ndarray:
    """The shard's tokens, memory-mapped read-only (an empty array for an empty shard)."""
    if shard.tokens == 0:
        return np.empty(0, shard.dtype)
    return np.memmap(shard.path, dtype=shard.dtype, mode="r", offset=shard.offset,
                     shape=(shard.tokens,))


def write_shard(path: str, tokens: np.ndarray) -> None:
    """A ``.bin`` shard with its header: the dtype is ``tokens``'s (uint16 or uint32)."""
    dtype = np.dtype(tokens.dtype).name
    magic, version = MAGIC_OF[dtype]
    header = np.zeros(HEADER_INTS, np.int32)
    header[:3] = (magic, version, tokens.size)
    tmp = path + ".partial"
    with open(tmp, "wb") as fh:
        fh.write(header.tobytes())
        fh.write(np.ascontiguousarray(tokens).tobytes())
    os.replace(tmp, path)


def match(pattern: str) -> list[str]:
    """The files a glob (or plain path) names, sorted: the shard order is part of the
    sampler's determinism."""
    return sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))


def max_token(shards: list[Shard], chunk: int = 1 << 26) -> int:
    """The largest token id, read chunk by chunk (-1 for no tokens)."""
    top = -1
    for shard in shards:
        array = tokens_of(shard)
        for lo in range(0, array.size, chunk):
            top = max(top, int(array[lo:lo + chunk].max()))
    return top


def split_part(split: str, val_fraction: float) -> tuple[float, float]:
    """The part of each shard (fractions of its length) a split reads when the
    validation data is the last ``val_fraction`` of the training data."""
    cut = 1 - val_fraction
    return (0.0, cut) if split == "train" else (cut, 1.0)


def part_bounds(size: int, part: tuple[float, float]) -> tuple[int, int]:
    """Token positions ``[lo, hi)`` of a part of a ``size``-token shard."""
    return int(size * part[0]), int(size * part[1])


def window_count(sizes, seq_len: int, part: tuple[float, float] = (0.0, 1.0)) -> int:
    """How many windows ``TokenWindows`` numbers in that part of shards of these sizes:
    the control plane checks a spec with the count the workers will sample from."""
    return sum(max(0, hi - lo - seq_len) for lo, hi in (part_bounds(n, part) for n in sizes))


class TokenWindows:
    """Windows of ``seq_len + 1`` tokens that lie inside one shard's part
    ``[lo, hi)`` (fractions of its length), numbered across shards in order."""

    def __init__(self, arrays: list[np.ndarray], seq_len: int,
                 part: tuple[float, float] = (0.0, 1.0)):
        self.arrays, self.seq_len = arrays, seq_len
        self.bounds = [part_bounds(a.size, part) for a in arrays]
        counts = [max(0, hi - lo - seq_len) for lo, hi in self.bounds]
        self.ends = np.cumsum(counts)
        self.total = int(self.ends[-1]) if counts else 0

    def window(self, index: int) -> np.ndarray:
        i = int(np.searchsorted(self.ends, index, side="right"))
        start = self.bounds[i][0] + index - (int(self.ends[i - 1]) if i else 0)
        return np.asarray(self.arrays[i][start:start + self.seq_len + 1], dtype=np.int64)

    def starts(self, step: int, count: int, seed: int) -> np.ndarray:
        """The window numbers of a global batch: a pure function of (seed, step)."""
        rng = np.random.Generator(np.random.PCG64([seed, step]))
        return rng.integers(0, self.total, size=count)

    def rows(self, step: int, seed: int, count: int, lo: int, hi: int) -> np.ndarray:
        """Rows ``lo:hi`` of the ``count``-window global batch of ``step``, int64
        ``[hi - lo, seq_len + 1]``; only those windows are read."""
        picked = self.starts(step, count, seed)[lo:hi]
        return np.stack([self.window(int(i)) for i in picked])
