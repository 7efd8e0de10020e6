"""Sharded, reshardable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Nothing is gathered to one rank: owners write their full matrices and momentum by FQN,
FSDP2 params and AdamW state go as DTensors. A checkpoint is a flat DCP state dict with
keys ``model/<fqn>``, ``optim/<fqn>/<state>``, ``optim_groups`` and ``extra``; loading
asks for keys by FQN on whatever layout the model now has, so a checkpoint written on
one R x N layout loads on another. A pipeline's stages keep the model's FQNs, so its
checkpoint has the whole model's keys and loads on another pp degree, or none
(``dmuon.pipeline_state``).

``save`` writes into ``<path>.partial`` and renames it to ``<path>`` only once every
rank has finished and a manifest of file sizes is written, so a save killed midway
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from . import normuon
from .fqn import canonical_fqn, param_names
from .full_state import raw_state_dict, units_by_key
from .model_state import get_state

MANIFEST = "dmuon_manifest.json"
GROUP_KEYS_SKIPPED = ("params",)


def ensure_optimizer_state(optimizer) -> None:
    """Materialise state the optimizer creates lazily, with the values its first step
    would start from, so that every rank knows which tensors to load into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            s = optimizer.state[p]
            if group["kind"] == "muon":
                s.setdefault("momentum_buffer", torch.zeros_like(p))
                if group["variant"] == "normuon":
                    s.setdefault(normuon.ROW_STATE, normuon.second_moment_like(p))
            elif not s:
                s["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                s["exp_avg"] = torch.zeros_like(p)
                s["exp_avg_sq"] = torch.zeros_like(p)


def _tp_wrapped(tensor: torch.Tensor, tp, per_row: bool = False) -> torch.Tensor:
    """An owner's TP shard as the DTensor it is, so DCP stores (and reshards) it by
    position rather than taking one peer's shard for the whole matrix; ``per_row``: a
    state of one value per row (NorMuon's), split like the matrix's rows."""
    if tp is None or tensor.ndim != 2:
        return tensor
    return tp.rows_as_dtensor(tensor) if per_row else tp.as_dtensor(tensor)


def _by_expert(plan, unit: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A slice of experts as one entry per expert (``<fqn>[e]``, a view), so the keys do
    not depend on how a layout sliced the param; anything else under its own name."""
    a = plan.params.get(unit)
    if a is None or a.experts is None:
        return {canonical_fqn(unit): tensor}
    lo, hi = a.experts
    return {f"{canonical_fqn(a.param)}[{e}]": tensor[e - lo] for e in range(lo, hi)}


def global_model_keys(model: nn.Module) -> set[str]:
    raw = raw_state_dict(model)
    plan = get_state(model).plan
    units_of, keys = units_by_key(plan), set()
    for key in raw:
        for unit in units_of.get(key, [key]):
            a = plan.params.get(unit)
            if a is not None and a.experts is not None:
                keys.update(f"{key}[{e}]" for e in range(*a.experts))
            else:
                keys.add(key)
    return keys


def _scalar_dtype() -> torch.dtype:
    # what torch.optim.AdamW uses for its "step" counter
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def model_share(model: nn.Module) -> dict:
    """This rank's share of the model's state, by FQN: dedicated params on their owners,
    as the masters (fp32 under mixed precision); everything else as FSDP2 DTensors."""
    state = get_state(model)
    state.drain()
    raw = raw_state_dict(model)
    column_owned = {m.fqn: _tp_wrapped(b.masters[m.fqn], m.tp)
                    for b in state.boundaries for m in b.owned}
    units_of = units_by_key(state.plan)
    model_sd = {}
    for key, value in raw.items():
        if key not in units_of:
            model_sd[key] = value
        for unit in units_of.get(key, ()):
            if unit in column_owned:
                model_sd.update(_by_expert(state.plan, unit, column_owned[unit]))
    return model_sd


def optimizer_share(model: nn.Module, optimizer) -> dict:
    """This rank's share of the optimizer's state, ``{fqn: {state_name: tensor}}``, plus
    the ``param_groups`` hyperparameters."""
    state = get_state(model)
    tp_of = {m.fqn: m.tp for b in state.boundaries for m in b.members if m.tp is not None}
    ensure_optimizer_state(optimizer)
    names = param_names(model)
    names.update({id(own): fqn for fqn, own in state.owned_params.items()})
    optim_state = {}
    for p, s in optimizer.state.items():
        for name, value in s.items():
            value = _tp_wrapped(value, tp_of.get(names[id(p)]), name == normuon.ROW_STATE)
            for key, v in _by_expert(state.plan, names[id(p)], value).items():
                optim_state.setdefault(key, {})[name] = v
    return {
        "state": optim_state,
        "param_groups": [
            {k: v for k, v in g.items() if k not in GROUP_KEYS_SKIPPED}
            for g in optimizer.param_groups
        ],
    }


def _pipelined(optimizer) -> bool:
    """A ``dmuon.PipelineMuon``: it holds this rank's stages and gives their shares
    under the whole model's FQNs (``dmuon.pipeline_state``); ``model`` is then this
    rank's stage modules, for the reader."""
    return hasattr(optimizer, "checkpoint_share")


def get_state_dict(model: nn.Module, optimizer) -> tuple[dict, dict]:
    """``(model_share(model), optimizer_share(model, optimizer))``: this rank's share
    (a pipeline's: every stage's it holds)."""
    if _pipelined(optimizer):
        return optimizer.checkpoint_share()
    return model_share(model), optimizer_share(model, optimizer)


def lacking(target: dict, given: dict) -> list[str]:
    return [f"model/{k}" for k in target if k not in given]


def lacking_optim(target: dict, given: dict) -> list[str]:
    return [f"optim/{k}/{n}" for k, s in target["state"].items() for n in s
            if n not in given["state"].get(k, {})]


def raise_lacking(missing: list[str]) -> None:
    if missing:
        raise KeyError(f"state dict lacks {len(missing)} keys this rank needs: "
                       f"{_preview(missing)}")


@torch.no_grad()
def copy_model(target: dict, model_sd: dict) -> None:
    for key, dst in target.items():
        copy_tensor(dst, model_sd[key], f"model/{key}")


@torch.no_grad()
def _copy_optimizer(optimizer, target: dict, optim_sd: dict) -> None:
    for fqn, tensors in target["state"].items():
        for name, dst in tensors.items():
            copy_tensor(dst, optim_sd["state"][fqn][name], f"optim/{fqn}/{name}")
    load_groups(optimizer, optim_sd["param_groups"])


def load_groups(optimizer, saved_groups: list[dict]) -> None:
    """Saved hyperparameters into the optimizer's groups, by position."""
    skipped = (*GROUP_KEYS_SKIPPED, "kind", "use_muon")  # what a group is, not a setting
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k not in skipped})


def republish(model: nn.Module) -> None:
    for b in get_state(model).boundaries:  # the owners' loaded values reach their replicas
        b.publish()
        b.transfer.start_replicate()
        b.transfer.wait_replicate()


def load_model_share(model: nn.Module, model_sd: dict) -> None:
    """Copy a ``model_share``-shaped dict of the same layout into the model."""
    target = model_share(model)
    raise_lacking(lacking(target, model_sd))
    copy_model(target, model_sd)
    republish(model)


def load_optimizer_share(model: nn.Module, optimizer, optim_sd: dict) -> None:
    """Copy an ``optimizer_share``-shaped dict of the same layout into the optimizer."""
    target = optimizer_share(model, optimizer)
    raise_lacking(lacking_optim(target, optim_sd))
    _copy_optimizer(optimizer, target, optim_sd)


def set_state_dict(model: nn.Module, optimizer, state_dict) -> None:
    """Copy a ``get_state_dict``-shaped ``(model_sd, optim_sd)`` into model and optimizer;
    every key is checked before anything is written."""
    if _pipelined(optimizer):
        optimizer.load_checkpoint_share(state_dict)
        return
    model_sd, optim_sd = state_dict
    target_model, target_optim = get_state_dict(model, optimizer)
    raise_lacking(lacking(target_model, model_sd) + lacking_optim(target_optim, optim_sd))
    copy_model(target_model, model_sd)
    _copy_optimizer(optimizer, target_optim, optim_sd)
    republish(model)


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, key: str) -> None:
    if dst is src:
        return
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{key}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    if hasattr(dst, "to_local") and hasattr(src, "to_local"):
        dst.to_local().copy_(src.to_local())
    else:
        dst.copy_(src)


# -- files ---------------------------------------------------------------------------

def _flat(model_sd: dict, optim_sd: dict, extra: dict | None) -> dict:
    flat = {f"model/{k}": v for k, v in model_sd.items()}
    for fqn, tensors in optim_sd["state"].items():
        for name, value in tensors.items():
            flat[f"optim/{fqn}/{name}"] = value
    groups = [{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in g.items()}
              for g in optim_sd["param_groups"]]
    flat["optim_groups"] = json.dumps(groups)
    flat["extra"] = json.dumps(extra or {})
    return flat


def _rank0() -> bool:
    return dist.get_rank() == 0


def _committed(path: str) -> str:
    """``path``, or its predecessor if a save was killed between its two renames."""
    old = f"{path}.old"
    if not os.path.isdir(path) and os.path.isfile(os.path.join(old, MANIFEST)):
        return old
    return path


def save(path: str, model: nn.Module, optimizer, extra: dict | None = None) -> None:
    """Collective sharded save; ``extra`` (JSON-able: step, data position) rides along.
    Under a pipeline ``model`` is this rank's stage modules and ``optimizer`` the
    ``dmuon.PipelineMuon`` over them: the keys are the whole model's FQNs."""
    path = os.path.abspath(path)
    partial = f"{path}.partial"
    if _rank0():
        shutil.rmtree(partial, ignore_errors=True)
        if _committed(path) != path:
            os.rename(_committed(path), path)
    dist.barrier()
    dcp.save(_flat(*get_state_dict(model, optimizer), extra), checkpoint_id=partial)
    dist.barrier()
    if _rank0():
        sizes = {f: os.path.getsize(os.path.join(partial, f)) for f in sorted(os.listdir(partial))}
        with open(os.path.join(partial, MANIFEST), "w") as fh:
            json.dump({"files": sizes}, fh)
        old = f"{path}.old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def _verify_files(path: str) -> None:
    if not os.path.isdir(path):
        hint = " (a save was interrupted: see .partial)" if os.path.isdir(f"{path}.partial") else ""
        raise FileNotFoundError(f"no checkpoint directory at {path}{hint}")
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        raise ValueError(f"{path} is not a complete DMuon checkpoint: {MANIFEST} is missing")
    with open(manifest) as fh:
        files = json.load(fh)["files"]
    for name, size in files.items():
        full = os.path.join(path, name)
        have = os.path.getsize(full) if os.path.isfile(full) else None
        if have != size:
            state = "missing" if have is None else f"truncated ({have} of {size} bytes)"
            raise ValueError(f"checkpoint {path}: file {name} is {state}")


def _check_keys(path: str, flat: dict, keys: set[str]) -> None:
    """Name what this model (its ``keys``) needs and the checkpoint lacks, and what it
    has in excess."""
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = [k for k in flat if k not in meta]
    model_keys = {f"model/{k}" for k in keys}
    unexpected = [k for k in meta if k.startswith("model/") and k not in model_keys]
    mismatched = [
        f"{k}: checkpoint {tuple(meta[k].size)} != model {tuple(v.shape)}"
        for k, v in flat.items()
        if isinstance(v, torch.Tensor) and k in meta and hasattr(meta[k], "size")
        and tuple(meta[k].size) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys {_preview(missing)}")
    if unexpected:
        problems.append(f"unexpected keys (another model?) {_preview(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches {_preview(mismatched)}")
    if problems:
        raise ValueError(f"checkpoint {path} does not fit this model: " + "; ".join(problems))


def load(path: str, model: nn.Module, optimizer) -> dict:
    """Collective load onto the model's current layout; returns the saved ``extra``."""
    path = _committed(os.path.abspath(path))
    _verify_files(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    flat = _flat(model_sd, optim_sd, None)
    keys = optimizer.checkpoint_model_keys() if _pipelined(optimizer) \
        else global_model_keys(model)
    _check_keys(path, flat, keys)
    dcp.load(flat, checkpoint_id=path)
    optim_sd["param_groups"] = _decoded_groups(json.loads(flat["optim_groups"]),
                                               optim_sd["param_groups"])
    set_state_dict(model, optimizer, (model_sd, optim_sd))
    return json.loads(flat["extra"])


def _decoded_groups(saved_groups: list[dict], groups: list[dict]) -> list[dict]:
    """JSON's groups back to the types this optimizer's group of the same kind (else at
    the same position) holds: dtypes, tuples."""
    for i, saved in enumerate(saved_groups):
        like = next((g for g in groups if "kind" in saved and g.get("kind") == saved["kind"]),
                    groups[i] if i < len(groups) else {})
        for k, v in saved.items():
            if isinstance(like.get(k), torch.dtype):
                saved[k] = getattr(torch, v.removeprefix("torch."))
            elif isinstance(like.get(k), tuple):
                saved[k] = tuple(v)
    return saved_groups


def _preview(keys: list[str], n: int = 8) -> str:
    shown = ", ".join(keys[:n])
    return f"[{shown}{', ...' if len(keys) > n else ''}] ({len(keys)} in all)"
