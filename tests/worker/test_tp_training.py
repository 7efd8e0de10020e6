"""The service's training loop on a (replicate, shard, tp) mesh: an HF Llama job (the
recipe of tests/helpers/hf_reference.py: clipping, warm-up and cosine schedule) on 4 gloo
ranks as 1 x 2 x 2, sequence parallel on the norms, against the float64 one-process
reference; its export loads with transformers' from_pretrained and holds the trained
tensors, and no rank logs DTensor's warning about sequential all-gathers (issue 53)."""

from __future__ import annotations

import logging

import torch
from helpers.hf_reference import LLAMA, RECIPE, reference_run

from dmuon.testing import run

LAYOUT = (1, 2, 2)
SPEC = {**RECIPE, "layout": {"replicate": 1, "shard": 2, "tp": 2},
        "model": {"hf_arch": LLAMA["architectures"][0], "config": LLAMA}}


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.job.inputs import resolve_inputs
    from service.job.job import Job
    from service.job.plan.make import plan_on_one_host
    from service.job.spec import parse_spec
    from service.worker.loop import run_training

    spec = parse_spec(SPEC)
    mesh = init_device_mesh("cpu", LAYOUT, mesh_dim_names=("replicate", "shard", "tp"))
    records, kept = [], _Kept()
    # DTensor's redistribute warns through logging (not warnings) when it plans a
    # multi-dim gather it cannot merge: the full state of a TP x FSDP param once did
    logging.getLogger("torch.distributed.tensor").addHandler(kept)
    job = Job.local(spec, plan_on_one_host(spec), inputs=resolve_inputs(spec, root),
                    export_dir=f"{root}/export")
    model = run_training(job, mesh, lambda record, path: records.append(record))
    return dmuon.full_state_dict(model), records, kept.lines


def test_llama_job_on_1x2x2_matches_reference_and_exports(tmp_path):
    import transformers

    results = run(_train, str(tmp_path), world_size=4)
    ref = reference_run(LLAMA, world=LAYOUT[0] * LAYOUT[1])
    for rank, (final, records, warned) in enumerate(results):
        assert not [w for w in warned if "redistributing" in w], (rank, warned)
        for key, value in ref.items():
            err = ((final[key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (rank, key, err)
        assert records[-1]["layout"] == list(LAYOUT)
        assert records[-1]["coord"] == [0, rank // 2, rank % 2]
        assert records[-1]["bytes"]  # the ledger's bytes, tp included
        # the packed buffers' high-water mark within the step, never below after it
        peak, after = records[-1]["peak_memory"], records[-1]["memory"]
        assert peak["packed_buffers"] >= max(after["packed_buffers"], 1), (peak, after)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export",
                                                               dtype=torch.float64)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, results[0][0][name]), name
