"""Token data: ``dmuon-svc prepare`` from JSONL with a tokenizer the test trains, the
shard format, the deterministic sampler, the memory-mapped read (a worker's RSS does not
grow with a 1 GB shard set), and every bad path or size refused naming its field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from service.job.inputs import resolve_inputs
from service.job.inputs.shards import TokenWindows, describe, tokens_of, write_shard
from service.job.spec import SpecError, parse_spec
from service.worker.batches import Batches

WORDS = ("muon", "owner", "shard", "gather", "reduce", "newton", "schulz", "matrix",
         "rank", "layer", "buffer", "step")


def _documents(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 40)))) for _ in range(n)]


def _tokenizer(path: str, docs: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(path)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    docs = _documents(300)
    with open(root / "corpus.jsonl", "w") as fh:
        for i, d in enumerate(docs):
            fh.write(json.dumps({"id": i, "text": d}) + "\n")
    _tokenizer(str(root / "tokenizer.json"), docs)
    proc = subprocess.run(
        [sys.executable, "-m", "service.control.cli", "prepare", "--tokenizer",
         str(root / "tokenizer.json"), "--out", str(root / "data" / "shards"),
         "--shard-tokens", "2000", "--val-every", "10", str(root / "corpus.jsonl")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return root, docs, json.loads(proc.stdout)


def test_prepare_writes_every_document_tokenized_in_order(prepared):
    from tokenizers import Tokenizer

    root, docs, meta = prepared
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    eot = tok.token_to_id("<|endoftext|>")
    for split, picked in (("train", [d for i, d in enumerate(docs, 1) if i % 10]),
                          ("val", [d for i, d in enumerate(docs, 1) if i % 10 == 0])):
        paths = sorted((root / "data" / "shards").glob(f"{split}_*.bin"))
        got = np.concatenate([tokens_of(describe(str(p))) for p in paths])
        want = np.concatenate([tok.encode(d, add_special_tokens=False).ids + [eot]
                               for d in picked])
        assert np.array_equal(got, want)
        assert all(describe(str(p)).tokens <= 2000 for p in paths)
        assert len(paths) > 1 or split == "val"  # 30 documents fit one shard
        assert meta["tokens"][split] == want.size
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["dtype"] == "uint16"


def test_sampler_is_a_pure_function_of_seed_and_step(prepared):
    root, _, meta = prepared
    spec = parse_spec({"model": "tiny", "seq_len": 32, "data": {
        "source": "shards/train_*.bin", "val_source": "shards/val_*.bin"}})
    inputs = resolve_inputs(spec, str(root / "data"))
    arrays = [tokens_of(describe(s["path"])) for s in inputs["data"]["train"]]
    windows = TokenWindows(arrays, 32)
    a = windows.rows(5, seed=3, count=16, lo=0, hi=16)
    b = TokenWindows(arrays, 32).rows(5, seed=3, count=16, lo=4, hi=8)
    assert np.array_equal(a[4:8], b)  # a rank reads only its rows, the same ones
    assert not np.array_equal(a, windows.rows(6, seed=3, count=16, lo=0, hi=16))
    flat = np.concatenate(arrays)
    for row in a:  # every window is a contiguous run of one shard's tokens
        starts = np.flatnonzero(flat[:-32] == row[0])
        assert any(np.array_equal(flat[s:s + 33], row) for s in starts)
    assert inputs["data"]["vocab"] == meta["vocab_size"]  # from prepare's meta.json


def _rss_bytes() -> int:
    """This process's resident set now (file-backed pages of the memory map included)."""
    with open("/proc/self/status") as fh:
        line = next(line for line in fh if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _rss_after_training(rank, world, spec_data, inputs):
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.worker.loop import run_training

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    before = _rss_bytes()
    job = Job.local(spec_data, plan_on_one_host(spec_data), inputs=inputs)
    run_training(job, mesh, lambda r, p: None)
    return _rss_bytes() - before


def _token_file(path: str, tokens: int) -> None:
    """A shard of ``tokens`` uint16 ids with its header; sparse (no disk blocks)."""
    write_shard(path, np.zeros(0, np.uint16))
    header = bytearray(open(path, "rb").read())
    header[8:12] = np.int32(tokens).tobytes()
    with open(path, "wb") as fh:
        fh.write(header)
        fh.truncate(len(header) + 2 * tokens)


def test_workers_read_shards_memory_mapped_rss_flat_with_a_1gb_set(tmp_path):
    from dmuon.testing import run

    spec = {"model": "tiny", "steps": 6, "batch_size": 2, "seq_len": 64,
            "layout": {"replicate": 2, "shard": 2}, "data": {"source": "t/*.bin",
                                                             "val_every": 3}}
    growth = {}
    for label, shards, tokens in (("small", 1, 1 << 20), ("1 GB", 4, 1 << 27)):
        os.makedirs(tmp_path / label / "t")
        for i in range(shards):
            _token_file(str(tmp_path / label / "t" / f"{i}.bin"), tokens)
        with open(tmp_path / label / "t" / "meta.json", "w") as fh:
            json.dump({"vocab_size": 256}, fh)  # the zeros would be scanned otherwise
        inputs = resolve_inputs(parse_spec(spec), str(tmp_path / label))
        size = sum(s["tokens"] * 2 for s in inputs["data"]["train"])
        growth[label] = (size, run(_rss_after_training, spec, inputs))
    big_size, big = growth["1 GB"]
    small_size, small = growth["small"]
    assert big_size >= 1 << 30 and small_size <= 4 << 20
    print(f"RSS growth over training per rank, MiB: 1 GB set {[b >> 20 for b in big]}, "
          f"{small_size >> 20} MiB set {[b >> 20 for b in small]}")
    for rank in range(4):  # a whole read of the set would add 1 GB per worker
        assert big[rank] - small[rank] < 32 << 20, (rank, big[rank], small[rank])


def _refused(spec: dict, root: str) -> str:
    with pytest.raises(SpecError) as err:
        resolve_inputs(parse_spec(spec), root)
    return str(err.value).split(":", 1)[0]


def test_bad_paths_and_sizes_name_their_field(tmp_path):
    root = str(tmp_path)
    os.makedirs(tmp_path / "d")
    write_shard(str(tmp_path / "d" / "short.bin"), np.arange(30, dtype=np.uint16))
    write_shard(str(tmp_path / "d" / "ok.bin"), np.arange(4000, dtype=np.uint16) % 250)
    (tmp_path / "d" / "bad_header.bin").write_bytes(
        open(tmp_path / "d" / "ok.bin", "rb").read()[:-2])
    (tmp_path / "d" / "dir.bin").mkdir()
    with open(tmp_path / "cfg.json", "w") as fh:
        json.dump({"architectures": ["LlamaForCausalLM"], "vocab_size": 128,
                   "max_position_embeddings": 32}, fh)
    tokens = {"model": "tiny", "seq_len": 32}
    cases = [
        ({**tokens, "data": {"source": "d/none_*.bin"}}, "data.source"),
        ({**tokens, "data": {"source": "d/dir.bin"}}, "data.source"),
        ({**tokens, "data": {"source": "d/short.bin"}}, "data.source"),
        ({**tokens, "data": {"source": "d/bad_header.bin"}}, "data.source"),
        ({**tokens, "data": {"source": "d/ok.bin", "val_source": "d/short.bin"}},
         "data.val_source"),
        ({**tokens, "data": {"source": "missing.txt"}}, "data.source"),
        ({"model": {"hf": "cfg.json"}, "seq_len": 32, "data": {"source": "d/ok.bin"}},
         "data.source"),  # ids up to 249, vocab 128
        ({"model": {"hf": "cfg.json"}, "seq_len": 33}, "seq_len"),
        ({"model": {"hf": "nothing/"}, "seq_len": 16}, "model.hf"),
        ({"model": {"hf": "cfg.json", "weights": "d"}, "seq_len": 16}, "model.weights"),
    ]
    for spec, field in cases:
        assert _refused(spec, root) == field, spec
    assert resolve_inputs(parse_spec({**tokens, "data": {"source": "d/ok.bin"}}),
                          root)["data"]["vocab"] == 250  # scanned: largest id + 1


def test_a_spec_is_accepted_exactly_when_its_workers_find_windows(tmp_path):
    """The control plane's check and the workers' sampler agree at the edge, where the
    held-out part's rounding decides whether one window fits (the check once counted
    int(n x val_fraction) tokens held out; the workers hold out n - int(n x (1 - vf)))."""
    seq_len, vf, seen = 8, 0.05, set()
    for n in range(150, 200):
        write_shard(str(tmp_path / f"s{n}.bin"), np.arange(n, dtype=np.uint16) % 200)
        (tmp_path / f"t{n}.txt").write_bytes(bytes(i % 200 for i in range(n)))
        for name in (f"s{n}.bin", f"t{n}.txt"):
            spec = parse_spec({"model": "tiny", "seq_len": seq_len,
                               "data": {"source": name, "val_fraction": vf}})
            try:
                data, accepted = resolve_inputs(spec, str(tmp_path))["data"], True
            except SpecError:
                data, accepted = _worker_data(name, tmp_path), False
            try:
                for split in ("train", "val"):
                    Batches(data, split, seq_len, seed=0, val_fraction=vf)
                runs = True
            except ValueError:
                runs = False
            assert accepted == runs, (name, accepted, runs)
            seen.add(accepted)
    assert seen == {True, False}  # the range crosses the edge


def _worker_data(name: str, root) -> dict:
    """What resolve_data would hand the workers had it accepted the spec."""
    path = str(root / name)
    if name.endswith(".txt"):
        return {"kind": "text", "path": path}
    return {"kind": "tokens", "train": [describe(path).to_dict()], "val": None}


def test_npy_shards_and_raw_bin_with_the_spec_dtype(tmp_path):
    tokens = (np.arange(5000) * 7 % 251).astype(np.uint32)
    np.save(tmp_path / "a.npy", tokens[:3000])
    tokens[3000:].tofile(tmp_path / "b.bin")  # raw, no header: the spec names the dtype
    np.save(tmp_path / "matrix.npy", np.zeros((4, 4), np.int32))
    spec = parse_spec({"model": "tiny", "seq_len": 32, "data": {
        "source": "a.npy", "format": "tokens", "val_source": "b.bin", "dtype": "uint32"}})
    data = resolve_inputs(spec, str(tmp_path))["data"]
    assert [s["tokens"] for s in data["train"] + data["val"]] == [3000, 2000]
    assert np.array_equal(tokens_of(describe(data["train"][0]["path"])), tokens[:3000])
    assert np.array_equal(tokens_of(describe(data["val"][0]["path"], "uint32")), tokens[3000:])
    assert data["vocab"] == 251
    with pytest.raises(SpecError, match="^data.source: .*1-D integer array"):
        resolve_inputs(parse_spec({"model": "tiny", "data": {"source": "matrix.npy"}}),
                       str(tmp_path))
