"""The worker's device and the (replicate, shard) mesh over Ray Train's process group.

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


def build_mesh(replicate: int, shard: int) -> tuple[DeviceMesh, list[str]]:
    import ray

    node_ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    rows = mesh_rows(node_ids, replicate, shard)
    mesh = DeviceMesh(device().type, torch.tensor(rows), mesh_dim_names=("replicate", "shard"))
    return mesh, node_ids
