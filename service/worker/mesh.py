"""The worker's device and its mesh, built from the stored plan's ``Layout``: the
([pp,] replicate, shard[, tp]) dims ``Layout.mesh_dim_names`` names, over Ray Train's process
group.

Ray Train has set up the process group (gloo on CPUs, NCCL on GPUs); this never calls
``init_process_group``. World ranks are grouped by Ray node id, gathered from every
worker (simulated nodes on one host share one IP, so Ray's node rank cannot tell them
apart), and the (replicate, shard) mesh puts each shard group on one node.
"""

from __future__ import annotations

import collections
import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from service.job.layout import Layout


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


@dataclasses.dataclass(frozen=True)
class JobMesh:
    """The mesh a worker runs on and the ``Layout`` it was built from (torchtitan's
    ``ParallelDims.build_mesh``): ``get_mesh(names)`` is a dim or a group of dims;
    sizes are the layout's, never read back from the mesh."""

    layout: Layout
    device_mesh: DeviceMesh
    node_ids: list = dataclasses.field(compare=False)

    @classmethod
    def around(cls, layout: Layout, device_mesh: DeviceMesh) -> JobMesh:
        """A mesh built elsewhere (tests, benchmarks), refused unless it has the
        layout's dims and sizes; its ranks in order, ``workers_per_node`` to a node."""
        have = (tuple(device_mesh.mesh_dim_names or ()), tuple(device_mesh.shape))
        if have != (layout.mesh_dim_names, layout.mesh_shape):
            raise ValueError(f"a mesh of dims {have[0]} and sizes {have[1]} for the layout "
                             f"{layout.shown()} (dims {layout.mesh_dim_names})")
        return cls(layout, device_mesh, _in_order(layout, device_mesh.size()))

    def get_mesh(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if names == self.layout.mesh_dim_names:
            return self.device_mesh
        return self.device_mesh[names]

    def __getitem__(self, names):
        return self.get_mesh(names)

    def coordinates(self) -> list[int]:
        """This rank's coordinate on the mesh's dims."""
        return [self.get_mesh(d).get_local_rank() for d in self.layout.mesh_dim_names]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The data-parallel dims FSDP2 shards over: (replicate, shard) under HSDP."""
        return self.get_mesh(("replicate", "shard") if self.layout.dp_replicate_enabled
                             else "shard")

    def ran(self, ep: int, batch: tuple[int, int]) -> Layout:
        """The layout this worker ran, as the mesh and the hosts it spans hold it, with
        the EP group it cut the experts over and the batch split it ran: what it
        reports, equal to the plan's."""
        sizes = dict(zip(self.device_mesh.mesh_dim_names, self.device_mesh.shape))
        hosts = collections.Counter(self.node_ids)
        return Layout(sizes["replicate"], sizes["shard"], len(hosts), tp=sizes.get("tp", 1),
                      ep=ep, pp=sizes.get("pp", 1), workers_per_node=max(hosts.values()),
                      micro_batches=batch[0], rows_per_micro=batch[1],
                      pp_schedule=self.layout.pp_schedule,
                      pp_stages_per_rank=self.layout.pp_stages_per_rank)


def node_ids_from_ray() -> list[str]:
    """Every world rank's Ray node id (a collective: each worker gives its own)."""
    import ray

    bind_device(device())
    node_ids: list = [None] * dist.get_world_size()
    dist.all_gather_object(node_ids, ray.get_runtime_context().get_node_id())
    return node_ids


def _in_order(layout: Layout, world: int) -> list[str]:
    return [f"node-{r // layout.workers_per_node}" for r in range(world)]


def build_mesh(layout: Layout, node_ids: list[str] | None = None) -> JobMesh:
    """The mesh of ``layout`` over the world's ranks (under PP, ``pp`` x R rows of
    N x T ranks, pp outermost), each rank on the node
    ``node_ids`` names (None: ranks in order, ``layout.workers_per_node`` to a node, as
    a one-host test runs them)."""
    if node_ids is None:
        node_ids = _in_order(layout, dist.get_world_size())
    rows = mesh_rows(node_ids, layout.pp * layout.replicate, layout.shard * layout.tp)
    grid = tp_groups(rows, layout.tp, node_ids) if layout.tp_enabled else torch.tensor(rows)
    if layout.pp_enabled:  # pp outermost: stage p holds rows p R .. (p + 1) R - 1
        grid = grid.reshape(layout.pp, layout.replicate, *grid.shape[1:])
    return JobMesh(layout, DeviceMesh(device().type, grid,
                                      mesh_dim_names=layout.mesh_dim_names), node_ids)
