"""Built-in byte-level corpus: the Python standard library's own source files.

Present on every machine with no download; split deterministically into train and
validation by file (every 20th file, in sorted order, is validation).
"""

from __future__ import annotations

import pathlib
import sysconfig

import torch

from service.job.inputs.shards import part_bounds, split_part

VOCAB_SIZE = 256


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_corpus(split: str = "train", max_bytes: int = 4_000_000) -> torch.Tensor:
    """The split as a 1-D uint8 tensor of at most ``max_bytes`` bytes."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    chunks, total = [], 0
    for i, path in enumerate(_stdlib_files()):
        if (i % 20 == 19) != (split == "val"):
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    buf = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).clone()


def batch_at(corpus: torch.Tensor, step: int, batch_size: int, seq_len: int,
             seed: int = 0) -> torch.Tensor:
    """The global batch of ``step``: ``batch_size`` windows of ``seq_len + 1`` tokens.

    A pure function of (step, seed), so a resumed run sees the same data.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return corpus[idx].long()


def load_text_corpus(path: str, split: str = "train",
                     val_fraction: float = 0.05) -> torch.Tensor:
    """A text file's bytes; the last ``val_fraction`` is validation."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    data = pathlib.Path(path).read_bytes()
    lo, hi = part_bounds(len(data), split_part(split, val_fraction))
    return torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.uint8).clone()
