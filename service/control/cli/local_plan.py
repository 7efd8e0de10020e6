"""``dmuon-svc plan SPEC_FILE --nodes N --gpus-per-node G``: the plan on a hypothetical
cluster, made on this machine without the service (a GPU plan from a laptop). The
document is the one the service makes; its inventory says the nodes were given."""

from __future__ import annotations

import os


def local_plan(path: str, nodes: int, gpus_per_node: int,
               gpu_memory_gb: float | None) -> dict:
    from service.job.inputs.resolve import resolve_model
    from service.job.plan.inventory import synthetic_inventory
    from service.job.plan.make import placement_document
    from service.job.plan.predict import predict
    from service.job.spec import load_spec, parse_spec

    data = load_spec(path).model_dump(mode="json", exclude_unset=True)
    if gpus_per_node:  # one GPU per worker unless the spec asks for more
        res = data.get("resources_per_worker") or {}
        data["resources_per_worker"] = {"CPU": 1, **res, "GPU": res.get("GPU") or 1}
    if gpu_memory_gb is not None:
        data["dmuon"] = {**(data.get("dmuon") or {}), "device_memory_gb": gpu_memory_gb}
    spec = parse_spec(data)
    source, _ = resolve_model(spec, os.getcwd())  # an hf: path is read from here
    placement = predict(spec, synthetic_inventory(nodes, gpus_per_node),
                        model_source=source)
    inventory = {"source": "assumed", "nodes": nodes, "gpus_per_node": gpus_per_node,
                 "reason": "given on the command line"}
    return placement_document(placement, inventory).model_dump(mode="json")
