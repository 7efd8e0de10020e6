"""Export (collective sharded safetensors) and sharded loading, on 4 gloo processes (2x2
HSDP, float64): the directory loads with transformers' from_pretrained, whose tensors
equal the trained model's (dmuon.full_state_dict) and whose logits on a fixed batch
equal those of a model loaded with them; a new job started from the directory
(model.weights: each rank reads only its slices) holds exactly those tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.hf_reference import QWEN3_MOE, RECIPE

from dmuon.testing import run

STEPS = 3


def _train_export_reload(rank, world, spec_data, root):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.job.inputs import resolve_inputs
    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.job.spec import parse_spec
    from service.worker.loop import build_training, run_training

    spec = parse_spec(spec_data)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    job = Job.local(spec, plan_on_one_host(spec), inputs=resolve_inputs(spec, root),
                    export_dir=f"{root}/export")
    model = run_training(job, mesh, lambda record, path: None)
    trained = dmuon.full_state_dict(model)
    again = parse_spec({**spec_data, "model": {**spec_data["model"], "weights": "export"}})
    reloaded, _, _ = build_training(again, mesh, resolve_inputs(again, root))
    return trained, dmuon.full_state_dict(reloaded), sorted(os.listdir(f"{root}/export"))


# Qwen3-MoE: its fused 3-D experts are split across owners and reassembled by export;
# the Llama job of tests/system/test_workloads.py loads its export with from_pretrained too
@pytest.mark.parametrize("config", [QWEN3_MOE], ids=["qwen3_moe"])
def test_export_loads_with_from_pretrained_and_as_start_weights(tmp_path, config):
    import transformers

    spec = {**RECIPE, "steps": STEPS,
            "model": {"hf_arch": config["architectures"][0], "config": config}}
    trained, reloaded, files = run(_train_export_reload, spec, str(tmp_path))[0]
    with open(tmp_path / "export" / "model.safetensors.index.json") as fh:
        index = json.load(fh)
    written = {f for f in files if f.endswith(".safetensors")}
    assert set(index["weight_map"].values()) == written and len(written) > 1  # sharded
    assert set(index["weight_map"]) == set(trained)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float64, experts_implementation="eager")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    for name in trained:  # the sharded load reads back exactly what was written
        assert torch.equal(reloaded[name], trained[name]), name
    reference = transformers.AutoModelForCausalLM.from_config(
        loaded.config, dtype=torch.float64, experts_implementation="eager")
    reference.load_state_dict(trained)
    batch = torch.randint(0, config["vocab_size"], (3, 16), generator=torch.Generator()
                          .manual_seed(0))
    with torch.no_grad():
        got = loaded(input_ids=batch).logits
        want = reference(input_ids=batch).logits
    # same float64 weights and kernels: equal up to summation order (measured 0)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
