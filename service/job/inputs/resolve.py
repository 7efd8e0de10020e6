"""Everything a job reads from disk, resolved and checked before any worker starts.

Paths in a spec are relative to the data root. ``resolve_inputs`` turns them into
absolute paths (the workers get them in their config) and refuses, with the field
path, what cannot run: a path that does not exist or cannot be read, a glob that
matches nothing, an empty data set or one too short for ``seq_len``, a ``seq_len``
beyond the model's ``max_position_embeddings``, token ids beyond the model's
vocabulary, and a tracking sink whose package is not installed (``sink_packages``).
Torch-free: the control plane runs it on submission, the entrypoint again.
"""

from __future__ import annotations

import json
import os
import stat

from ..job_dir import CHECKPOINTS, STEP_DIR
from ..models.source import ModelSource
from ..spec import MAX_DATA_BYTES, JobSpec, SpecError
from ..spec.model_section import builtin_config
from .shards import ShardError, describe, match, max_token, split_part, window_count
from .sink_packages import check_sink_packages

BYTE_VOCAB = 256  # the built-in corpus and text files are read as bytes
META_FILE = "meta.json"  # written by `dmuon-svc prepare` next to its shards
MANIFEST = "dmuon_manifest.json"  # dmuon.checkpoint.MANIFEST: a committed checkpoint's


def _under_root(root: str, relative: str, field: str) -> str:
    root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, path]) != root:
        raise SpecError(f"{field}: {relative!r} leads outside the data root")
    return path


def _readable_file(path: str, shown: str, field: str) -> os.stat_result:
    try:
        info = os.stat(path)
    except OSError:
        raise SpecError(f"{field}: no file {shown!r} under the data root") from None
    if not stat.S_ISREG(info.st_mode):
        raise SpecError(f"{field}: {shown!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise SpecError(f"{field}: {shown!r} cannot be read")
    return info


def _shards(root: str, pattern: str, dtype: str | None, field: str) -> list[dict]:
    paths = [p for p in match(_under_root(root, pattern, field))
             if os.path.commonpath([os.path.realpath(root), os.path.realpath(p)])
             == os.path.realpath(root)]
    if not paths:
        raise SpecError(f"{field}: {pattern!r} matches no file under the data root")
    shards = []
    for path in paths:
        _readable_file(path, os.path.relpath(path, root), field)
        try:
            shards.append(describe(path, dtype))
        except (ShardError, ValueError, OSError) as e:
            raise SpecError(f"{field}: {e}") from None
    return shards


def _data_vocab(shards) -> int:
    """The data's vocabulary: ``meta.json`` of ``prepare`` when present, else the
    largest token id + 1 (read in chunks)."""
    meta = os.path.join(os.path.dirname(shards[0].path), META_FILE)
    if os.path.isfile(meta):
        with open(meta) as fh:
            return int(json.load(fh)["vocab_size"])
    return max_token(shards) + 1


def resolve_data(spec: JobSpec, root: str) -> dict:
    data = spec.data
    if data.source == "builtin":
        return {"kind": "builtin", "vocab": BYTE_VOCAB}
    if not data.tokens:
        path = _under_root(root, data.source, "data.source")
        info = _readable_file(path, data.source, "data.source")
        if info.st_size > MAX_DATA_BYTES:
            raise SpecError(f"data.source: {data.source!r} has {info.st_size} bytes; a text "
                            f"file is read whole, at most {MAX_DATA_BYTES}: tokenize it "
                            "into shards with `dmuon-svc prepare`")
        for split, field in (("train", "data.source"), ("val", "data.val_fraction")):
            if window_count([info.st_size], spec.seq_len,
                            split_part(split, data.val_fraction)) == 0:
                raise SpecError(f"{field}: {data.source!r} ({info.st_size} bytes) has no "
                                f"{split} window of seq_len+1={spec.seq_len + 1} bytes with "
                                f"val_fraction={data.val_fraction}")
        return {"kind": "text", "path": path, "vocab": BYTE_VOCAB}
    train = _shards(root, data.source, data.dtype, "data.source")
    val = _shards(root, data.val_source, data.dtype, "data.val_source") \
        if data.val_source else None
    sizes = [s.tokens for s in train]
    if window_count(sizes, spec.seq_len,
                    (0.0, 1.0) if val else split_part("train", data.val_fraction)) == 0:
        raise SpecError(f"data.source: {sum(sizes)} tokens in "
                        f"{len(train)} shard(s): no training window of seq_len+1="
                        f"{spec.seq_len + 1} tokens fits in one shard")
    val_sizes, val_part = ([s.tokens for s in val], (0.0, 1.0)) if val else \
        (sizes, split_part("val", data.val_fraction))
    if window_count(val_sizes, spec.seq_len, val_part) == 0:
        raise SpecError(f"{'data.val_source' if val else 'data.val_fraction'}: no "
                        f"validation window of {spec.seq_len + 1} tokens fits")
    vocab = max(_data_vocab(train), _data_vocab(val) if val else 0)
    return {"kind": "tokens", "train": [s.to_dict() for s in train],
            "val": [s.to_dict() for s in val] if val else None, "vocab": vocab}


def hf_config(spec: JobSpec, root: str) -> tuple[dict, str | None]:
    """(config fields, the config.json's directory or None) of a Hugging Face model."""
    model, fields, where = spec.model, {}, None
    if model.hf is not None:
        path = _under_root(root, model.hf, "model.hf")
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        _readable_file(path, model.hf, "model.hf")
        try:
            with open(path) as fh:
                fields = json.load(fh)
        except ValueError as e:
            raise SpecError(f"model.hf: {model.hf!r} is not JSON: {e}") from None
        where = os.path.dirname(path)
    return {**fields, **model.config}, where


def _hf_limits(spec: JobSpec, fields: dict) -> tuple[int | None, int | None]:
    vocab, longest = fields.get("vocab_size"), fields.get("max_position_embeddings")
    if vocab is None or longest is None:  # the config class's defaults
        import transformers

        arch = spec.model.architecture(fields)
        cls = getattr(transformers, arch, None) if arch else None
        if cls is None or not hasattr(cls, "config_class"):
            raise SpecError(f"model.hf_arch: unknown architecture {arch!r} in transformers")
        defaults = cls.config_class()
        vocab = vocab or defaults.vocab_size
        longest = longest or getattr(defaults, "max_position_embeddings", None)
    return vocab, longest


def resolve_model(spec: JobSpec, root: str) -> tuple[ModelSource, int | None]:
    """(the model's source, its vocabulary size when known)."""
    model = spec.model
    config = builtin_config(model)
    if config is not None:
        return ModelSource(kind="builtin"), config.vocab_size
    if hasattr(model, "factory"):
        return ModelSource(kind="factory"), model.vocab_size
    fields, where = hf_config(spec, root)
    vocab, longest = _hf_limits(spec, fields)
    if longest is not None and spec.seq_len > longest:
        raise SpecError(f"seq_len: {spec.seq_len} is beyond the model's "
                        f"max_position_embeddings={longest}")
    weights = None
    if model.weights is not None:
        weights = _under_root(root, model.weights, "model.weights")
        if not os.path.isdir(weights) or not match(os.path.join(weights, "*.safetensors")):
            raise SpecError(f"model.weights: no *.safetensors in {model.weights!r} under "
                            "the data root")
    return ModelSource(kind="hf", config=fields, config_dir=where, weights=weights), vocab


def newest_checkpoint(root: str) -> str | None:
    """The newest committed ``step_N`` directory under ``root`` (torch-free, as
    ``service.worker.checkpoints.latest_committed``), or None."""
    if not os.path.isdir(root):
        return None
    done = sorted((d for d in os.listdir(root) if STEP_DIR.fullmatch(d)
                   and os.path.isfile(os.path.join(root, d, MANIFEST))),
                  key=lambda d: int(STEP_DIR.fullmatch(d).group(1)))
    return os.path.join(root, done[-1]) if done else None


def _resume_path(value: str, data_root: str, storage: str | None) -> str:
    """A ``resume_from`` path: relative to the data root, or absolute under the data root
    or the storage root."""
    path = os.path.realpath(os.path.join(data_root, value))
    roots = [os.path.realpath(r) for r in (data_root, storage) if r]
    if not any(os.path.commonpath([r, path]) == r for r in roots):
        raise SpecError(f"checkpoint.resume_from: {value!r} is outside the data root and "
                        "the storage root")
    if not os.path.isdir(path):
        raise SpecError(f"checkpoint.resume_from: no directory {value!r}")
    return path


def resolve_resume(spec: JobSpec, data_root: str, storage: str | None) -> str | None:
    """The committed checkpoint ``checkpoint.resume_from`` names, absolute: a job id's
    newest in ``<storage>/<id>/dcp``; a path's own (a checkpoint, a directory of them, a
    job directory). SpecError naming the field when there is none."""
    value = spec.checkpoint.resume_from
    if value is None:
        return None
    if "/" not in value:  # a job id (the spec allows no other form without a '/')
        if storage is None or not os.path.isdir(os.path.join(storage, value)):
            raise SpecError(f"checkpoint.resume_from: no job {value!r} in the storage root")
        found = newest_checkpoint(os.path.join(storage, value, CHECKPOINTS))
    else:
        path = _resume_path(value, data_root, storage)
        found = path if os.path.isfile(os.path.join(path, MANIFEST)) else \
            newest_checkpoint(path) or newest_checkpoint(os.path.join(path, CHECKPOINTS))
    if found is None:
        raise SpecError(f"checkpoint.resume_from: {value!r} holds no committed checkpoint")
    step = STEP_DIR.fullmatch(os.path.basename(found))
    if step and int(step.group(1)) >= spec.steps:
        raise SpecError(f"checkpoint.resume_from: {value!r} is at step {int(step.group(1))}, "
                        f"steps is {spec.steps}: nothing left to train")
    return found


def resolve_inputs(spec: JobSpec, data_root: str, storage: str | None = None) -> dict:
    """``{"model": ..., "data": ..., "resume_from": ...}`` with absolute paths, or
    SpecError naming the field. ``storage``: the job directories' root (job ids in
    ``checkpoint.resume_from``)."""
    check_sink_packages(spec)
    model, model_vocab = resolve_model(spec, data_root)
    data = resolve_data(spec, data_root)
    if model_vocab is not None and data["vocab"] > model_vocab:
        raise SpecError(f"data.source: the data's vocabulary has {data['vocab']} ids, the "
                        f"model's vocab_size is {model_vocab}")
    return {"model": model, "data": data,
            "resume_from": resolve_resume(spec, data_root, storage)}


def inputs_json(inputs: dict) -> str:
    """``resolve_inputs``'s answer as the control plane keeps it in the job's directory
    (``job_dir.INPUTS``): the driver runs on it rather than resolving the spec again."""
    return json.dumps({**inputs, "model": inputs["model"].model_dump(mode="json")})


def stored_inputs(text: str) -> dict:
    """The inputs ``inputs_json`` wrote, as ``resolve_inputs`` answered them."""
    data = json.loads(text)
    return {**data, "model": ModelSource.model_validate(data["model"])}
