"""The final weights as sharded safetensors plus ``config.json``, written collectively:
every tensor is written by one rank that already holds it or a part of it, and only the
other parts of that one tensor travel to it (point-to-point). Nothing is gathered to one
rank. Hugging Face models load the directory with ``from_pretrained``; the built-in and
factory models with ``service.job.models.exported.load_exported`` (``safetensors`` and the
model class; ``model.safetensors.index.json`` maps each tensor to its file).

Dedicated matrices are written by their owner from its master; a 3-D expert tensor split
into slices of experts by the owner of one slice, which receives the others; FSDP2
params by one rank of the first replica row, which receives the other rows' shards.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon.planning import canonical_fqn
from service.job.layout import fsdp2_rows

from .mesh import JobMesh

INDEX = "model.safetensors.index.json"


@dataclass
class Piece:
    holder: int  # global rank
    local: torch.Tensor | None  # the part, on its holder only
    shape: tuple[int, ...]


@dataclass
class Entry:
    key: str
    pieces: list[Piece] = field(default_factory=list)  # concatenated along dim 0
    writer: int = -1

    @property
    def numel(self) -> int:
        return sum(torch.Size(p.shape).numel() for p in self.pieces)


def _dedicated_entries(model, mesh, rank: int) -> dict[str, Entry]:
    """Every owned unit from the plan, the same list on every rank: under expert
    parallelism a rank's boundaries hold only its EP coordinate's experts, the plan all."""
    state = dmuon.get_state(model)
    boundary = {m.fqn: b for b in state.boundaries for m in b.members}
    units = sorted(state.plan.params.values(),
                   key=lambda a: (a.experts or (0, 0))[0])  # slices in expert order
    entries: dict[str, Entry] = {}
    for a in units:
        holder = int(mesh.mesh[a.owner_coord[0], a.owner_coord[1]])
        local = boundary[a.fqn].masters[a.fqn].detach() if holder == rank else None
        key = canonical_fqn(a.param)
        entries.setdefault(key, Entry(key)).pieces.append(Piece(holder, local, tuple(a.shape)))
    return entries


def _sharded_entry(key: str, param, mesh, rank: int) -> Entry:
    """An FSDP2 param: its dim-0 chunks on the first replica row's shard ranks."""
    row = mesh.mesh[0] if mesh.ndim == 2 else mesh.mesh
    entry = Entry(key)
    for s in range(len(row)):
        lo, hi = fsdp2_rows(param.shape[0], len(row), s)
        count = hi - lo
        if count:
            holder = int(row[s])
            local = param.to_local().detach() if holder == rank else None
            entry.pieces.append(Piece(holder, local, (count, *param.shape[1:])))
    return entry


def _gathered_entries(model: nn.Module, rank: int) -> list[Entry]:
    """Under tensor parallelism: every param in full on rank 0 (``full_state_dict``,
    collective), since a TP shard's parts lie on several ranks of several owners."""
    full = dmuon.full_state_dict(model)
    return [Entry(canonical_fqn(name), [Piece(0, full[name] if rank == 0 else None,
                                              tuple(full[name].shape))])
            for name, _ in model.named_parameters()]


def _entries(model: nn.Module, job_mesh: JobMesh) -> list[Entry]:
    rank, mesh = dist.get_rank(), job_mesh.device_mesh
    if job_mesh.layout.tp_enabled:
        return _gathered_entries(model, rank)
    dedicated = _dedicated_entries(model, mesh, rank)
    entries = []
    for name, param in model.named_parameters():
        key = canonical_fqn(name)
        if key in dedicated:
            entries.append(dedicated[key])
        elif hasattr(param, "to_local"):
            entries.append(_sharded_entry(key, param, mesh, rank))
        else:  # a plain replicated tensor: every rank has it
            entries.append(Entry(key, [Piece(0, param.detach() if rank == 0 else None,
                                             tuple(param.shape))]))
    return entries


def _assign_writers(entries: list[Entry], world: int) -> None:
    """Largest first, each to its least-loaded holder (no transfer for one-piece
    tensors; the bytes written stay balanced)."""
    load = [0] * world
    for entry in sorted(entries, key=lambda e: -e.numel):
        holders = sorted({p.holder for p in entry.pieces})
        entry.writer = min(holders, key=lambda r: (load[r], r))
        load[entry.writer] += entry.numel


@torch.no_grad()
def _collect(entry: Entry, rank: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """The whole tensor on its writer (None elsewhere); parts travel by send/recv."""
    parts = []
    for piece in entry.pieces:
        if piece.holder == entry.writer:
            if rank == entry.writer:
                parts.append(piece.local.to(dtype))
        elif rank == piece.holder:
            dist.send(piece.local.to(dtype).contiguous(), dst=entry.writer)
        elif rank == entry.writer:
            buf = torch.empty(piece.shape, dtype=dtype, device=device)
            dist.recv(buf, src=piece.holder)
            parts.append(buf)
    if rank != entry.writer:
        return None
    return torch.cat(parts).cpu().contiguous() if len(parts) > 1 else parts[0].cpu().contiguous()


def _umask() -> int:
    """This process's umask, read without changing it (Linux reports it in /proc)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def export(model: nn.Module, mesh: JobMesh, out_dir: str, *, dtype: torch.dtype,
           write_config) -> str:
    """Write the model to ``out_dir`` (replacing it); collective. ``write_config(dir)``
    runs on rank 0 and writes ``config.json``."""
    from safetensors.torch import save_file

    rank, world = dist.get_rank(), dist.get_world_size()
    dmuon.get_state(model).drain()
    entries = _entries(model, mesh)
    _assign_writers(entries, world)
    writers = sorted({e.writer for e in entries})
    names = {w: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors"
             for i, w in enumerate(writers)}
    device = next(iter(model.parameters())).device
    mine = {}
    for entry in entries:  # one fixed order on every rank: sends meet their receives
        full = _collect(entry, rank, dtype, device if device.type != "meta" else "cpu")
        if full is not None:
            mine[entry.key] = full
    partial = out_dir + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    if mine:
        path = os.path.join(partial, names[rank])
        save_file(mine, path, metadata={"format": "pt"})
        # safetensors writes a private temporary file and renames it (mode 0600): make
        # it as readable as config.json beside it
        os.chmod(path, 0o666 & ~_umask())
    dist.barrier()
    if rank == 0:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        index = {"metadata": {"total_size": sum(e.numel for e in entries) * itemsize},
                 "weight_map": {e.key: names[e.writer] for e in entries}}
        with open(os.path.join(partial, INDEX), "w") as fh:
            json.dump(index, fh, indent=2, sort_keys=True)
        write_config(partial)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(partial, out_dir)
    dist.barrier()
    return out_dir
