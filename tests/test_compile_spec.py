"""A job spec's ``compile: true`` reaches the service's workers (the core's compiled
blocks are checked against eager in tests/core/test_compile.py)."""

from __future__ import annotations

from dmuon.testing import run


def _spec_compiles(rank, world):
    """A job spec's ``compile: true`` reaches the worker: each block compiled in place."""
    from torch.distributed.device_mesh import init_device_mesh

    from service.spec import parse_spec
    from service.train.loop import build_training

    spec = parse_spec({"model": "tiny", "compile": True,
                       "layout": {"replicate": 1, "shard": world}})
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model, _, _ = build_training(spec, mesh)
    return [getattr(layer, "_compiled_call_impl", None) is not None
            for layer in model.model.layers], spec.compile.options()


def test_the_specs_compile_true_compiles_each_block_in_place():
    for compiled, options in run(_spec_compiles, world_size=2):
        assert compiled == [True, True] and options["backend"] == "inductor"
