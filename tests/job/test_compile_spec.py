"""A job spec's ``compile: true`` reaches the service's workers (the core's compiled
blocks are checked against eager in tests/core/test_compile.py)."""

from __future__ import annotations

import pytest

from dmuon.testing import run
from service.job.spec import SpecError, parse_spec


def _spec_compiles(rank, world):
    """A job spec's ``compile: true`` reaches the worker: each block compiled in place."""
    from torch.distributed.device_mesh import init_device_mesh

    from service.job.spec import parse_spec
    from service.worker.loop import build_training

    spec = parse_spec({"model": "tiny", "compile": True,
                       "layout": {"replicate": 1, "shard": world}})
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model, _, _ = build_training(spec, mesh)
    return [getattr(layer, "_compiled_call_impl", None) is not None
            for layer in model.model.layers], spec.compile.options()


def test_the_specs_compile_true_compiles_each_block_in_place():
    for compiled, options in run(_spec_compiles, world_size=2):
        assert compiled == [True, True] and options["backend"] == "inductor"


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_compile_modes_are_refused_unless_z2(mode):
    for dmuon_mode in ("z3", "auto"):
        with pytest.raises(SpecError, match=r"compile\.mode: compile\.mode=" + mode):
            parse_spec({"compile": {"enabled": True, "mode": mode},
                        "dmuon": {"mode": dmuon_mode}})
    spec = parse_spec({"compile": {"enabled": True, "mode": mode}, "dmuon": {"mode": "z2"}})
    assert spec.compile.options()["mode"] == mode
    # without CUDA graphs, Z3 is fine
    parse_spec({"compile": {"enabled": True, "mode": "max-autotune-no-cudagraphs"}})
