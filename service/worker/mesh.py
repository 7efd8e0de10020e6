"""The worker's device and the (replicate, shard[, tp]) mesh over Ray Train's process
group.

Ray Train has set up the process group (gloo on CPUs, NCCL on GPUs); this never calls
``init_process_group``. World ranks are grouped by Ray node id, gathered from every
worker (simulated nodes on one host share one IP, so Ray's node rank cannot tell them
apart), and the (replicate, shard) mesh puts each shard group on one node.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def mesh_rows(node_ids: list[str], replicate: int, shard: int) -> list[list[int]]:
    """World ranks as ``replicate`` rows of ``shard`` ranks, each row on one node when a
    node has at least ``shard`` workers (rows then span nodes in whole-node blocks)."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(rank)
    ordered = [rank for ranks in by_node.values() for rank in ranks]
    if len(ordered) != replicate * shard:
        raise ValueError(f"{len(ordered)} workers for a {replicate} x {shard} mesh")
    return [ordered[r * shard:(r + 1) * shard] for r in range(replicate)]


def device() -> torch.device:
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)  # DMuon and FSDP2 allocate on the current device
        return dev
    return torch.device("cpu")


def bind_device(dev: torch.device) -> None:
    """On CUDA, connect the world's NCCL communicator now, on this worker's own device.
    Ray Train's TorchConfig calls ``init_process_group`` without ``device_id`` (ray
    2.60's ``_setup_torch_process_group``), so NCCL would initialise lazily at the first
    collective, on whatever device is current then; a barrier naming the device is the
    same eager connection ``device_id`` makes. Before it, ``all_gather_object`` on NCCL
    would run on cuda:0 on every worker of a host."""
    if dev.type == "cuda":
        dist.barrier(device_ids=[dev.index])


def tp_groups(rows: list[list[int]], tp: int, node_ids: list[str]) -> torch.Tensor:
    """The (replicate, shard, tp) grid: each row's ranks in groups of ``tp``, each group
    on one node (its activation collectives run over the node's NVLink, never between
    hosts)."""
    grid = torch.tensor(rows).reshape(len(rows), -1, tp)
    for group in grid.reshape(-1, tp).tolist():
        if len({node_ids[r] for r in group}) > 1:
            raise ValueError(f"tensor-parallel group of ranks {group} spans nodes: "
                             "layout.tp must divide the workers of every node")
    return grid


def build_mesh(replicate: int, shard: int, tp: int = 1) -> tuple[DeviceMesh, list[str]]:
    """The (replicate, shard) mesh, or (replicate, shard, tp) with ``tp > 1``."""
    import ray

    bind_device(device())
    node_ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    rows = mesh_rows(node_ids, replicate, shard * tp)
    if tp == 1:
        return DeviceMesh(device().type, torch.tensor(rows),
                          mesh_dim_names=("replicate", "shard")), node_ids
    return DeviceMesh(device().type, tp_groups(rows, tp, node_ids),
                      mesh_dim_names=("replicate", "shard", "tp")), node_ids


def tp_size(mesh: DeviceMesh) -> int:
    """T of a (replicate, shard, tp) mesh; 1 for a (replicate, shard) one."""
    return mesh["tp"].size() if "tp" in (mesh.mesh_dim_names or ()) else 1
