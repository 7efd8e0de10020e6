"""The driver's view of the cluster it runs on: the alive nodes of the connected Ray
cluster (the driver is a Ray driver; the control plane reads the dashboard instead)."""

from __future__ import annotations

from service.job.plan.inventory import NodeInfo


def inventory_from_ray() -> list[NodeInfo]:
    """The alive nodes of the connected Ray cluster with their logical resources."""
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        nodes.append(NodeInfo(n["NodeID"], n["NodeManagerAddress"], res.get("CPU", 0),
                              res.get("GPU", 0), dict(res)))
    return nodes
