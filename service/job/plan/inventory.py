"""A cluster as the planner sees it: its alive nodes and their logical resources (read
from Ray by the driver or the control plane, or synthetic for planning)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    cpus: float
    gpus: float
    resources: dict = field(default_factory=dict)


def synthetic_inventory(nodes: int, gpus_per_node: int, cpus_per_node: int = 64):
    return [NodeInfo(f"node{i}", f"10.0.0.{i}", cpus_per_node, gpus_per_node)
            for i in range(nodes)]
