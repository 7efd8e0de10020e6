"""``dmuon-svc prepare``: text or JSONL into token shards for ``data.source``.

    dmuon-svc prepare --tokenizer tokenizer.json --out data/shards corpus.jsonl [more ...]
    ray job submit ... -- python -m service.job.inputs.prepare --ray --tokenizer ... --out ...

Inputs: ``.jsonl`` files (one JSON object per line; ``--field``, default ``text``) or
plain text files (one document each). Each document is tokenized with a Hugging Face
``tokenizers`` ``tokenizer.json`` (``encode_batch``: the library's own thread pool uses
every core), followed by the end-of-text token when the vocabulary has one. Every
``--val-every``-th document goes to the validation shards. Output: ``train_NNNNNN.bin``
and ``val_NNNNNN.bin`` of at most ``--shard-tokens`` tokens each (uint16 when the
vocabulary fits, else uint32, with the 256-int32 header), and ``meta.json``. With
``--ray``, Ray Data reads and tokenizes the inputs on the cluster's CPUs (large
inputs); shards are written in input order either way, so the output is the same.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator

import numpy as np

from .shards import write_shard

EOT_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
BATCH_DOCS = 1024

# --help's usage line: argparse would name the file
PROG = "python -m service.job.inputs.prepare"


def documents(paths: list[str], field: str) -> Iterator[str]:
    """Documents in input order: JSONL lines' ``field``, or whole text files."""
    for path in paths:
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if not isinstance(record.get(field), str):
                        raise ValueError(f"{path}:{number}: no string field {field!r}")
                    yield record[field]
        else:
            with open(path, encoding="utf-8") as fh:
                yield fh.read()


def _batched(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class ShardWriter:
    """Tokens appended in order, cut into shards of at most ``shard_tokens``."""

    def __init__(self, out: str, split: str, shard_tokens: int, dtype):
        self.out, self.split, self.limit, self.dtype = out, split, shard_tokens, dtype
        self.parts: list[np.ndarray] = []
        self.held = self.shards = self.tokens = 0

    def add(self, ids: list[int]) -> None:
        array = np.asarray(ids, dtype=self.dtype)
        while array.size:
            room = self.limit - self.held
            self.parts.append(array[:room])
            self.held += min(room, array.size)
            array = array[room:]
            if self.held == self.limit:
                self.flush()

    def flush(self) -> None:
        if self.held:
            path = os.path.join(self.out, f"{self.split}_{self.shards:06d}.bin")
            write_shard(path, np.concatenate(self.parts))
            self.shards, self.tokens = self.shards + 1, self.tokens + self.held
            self.parts, self.held = [], 0


def _encoded(tokenizer_path: str, batches: Iterable[list[str]], eot: int | None):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    for batch in batches:
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            yield enc.ids + ([eot] if eot is not None else [])


def _ray_encoded(tokenizer_path: str, paths: list[str], field: str, eot: int | None):
    """The same documents tokenized by Ray Data's workers, in input order."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True

    def encode(batch):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(tokenizer_path)
        out = [np.asarray(e.ids + ([eot] if eot is not None else []), dtype=np.int64)
               for e in tokenizer.encode_batch(list(batch["text"]), add_special_tokens=False)]
        return {"ids": np.array(out, dtype=object)}

    rows = ray.data.from_items([{"text": d} for d in documents(paths, field)])
    for batch in rows.map_batches(encode, batch_size=BATCH_DOCS).iter_batches(
            batch_size=BATCH_DOCS, batch_format="numpy"):
        yield from (ids.tolist() for ids in batch["ids"])


def prepare(paths: list[str], tokenizer_path: str, out: str, *, field: str = "text",
            val_every: int = 20, shard_tokens: int = 100_000_000, use_ray: bool = False) -> dict:
    """Tokenize ``paths`` into shards under ``out``; returns the ``meta.json`` content."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eot = next((tokenizer.token_to_id(t) for t in EOT_TOKENS
                if tokenizer.token_to_id(t) is not None), None)
    dtype = np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.uint32
    os.makedirs(out, exist_ok=True)
    writers = {s: ShardWriter(out, s, shard_tokens, dtype) for s in ("train", "val")}
    stream = (_ray_encoded(tokenizer_path, paths, field, eot) if use_ray else
              _encoded(tokenizer_path, _batched(documents(paths, field), BATCH_DOCS), eot))
    count = 0
    for count, ids in enumerate(stream, 1):
        writers["val" if val_every and count % val_every == 0 else "train"].add(ids)
    for writer in writers.values():
        writer.flush()
    with open(tokenizer_path, "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    meta = {"vocab_size": vocab, "dtype": np.dtype(dtype).name, "eot_id": eot,
            "documents": count, "tokenizer_sha256": digest,
            "tokens": {s: w.tokens for s, w in writers.items()},
            "shards": {s: w.shards for s, w in writers.items()}}
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=2)
    return meta


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("inputs", nargs="+", help=".jsonl or text files")
    ap.add_argument("--tokenizer", required=True, help="a tokenizers tokenizer.json")
    ap.add_argument("--out", required=True, help="directory for the shards and meta.json")
    ap.add_argument("--field", default="text", help="the JSONL field holding the text")
    ap.add_argument("--val-every", type=int, default=20,
                    help="every K-th document goes to validation (0: none)")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000)
    ap.add_argument("--ray", action="store_true", help="tokenize with Ray Data")


def run(args) -> int:
    for path in [*args.inputs, args.tokenizer]:
        if not os.path.isfile(path):
            print(f"error: no file {path!r}", file=sys.stderr)
            return 2
    meta = prepare(args.inputs, args.tokenizer, args.out, field=args.field,
                   val_every=args.val_every, shard_tokens=args.shard_tokens,
                   use_ray=args.ray)
    print(json.dumps(meta))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
