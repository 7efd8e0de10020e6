"""Pipeline-parallel jobs through REST (issue 52, item 5): on a real control plane with
its own local Ray head (4 CPU workers), jobs with ``layout.pp: 2`` on the built-in
``tiny`` model, on a Hugging Face Llama built from its config, PP 2 x EP 2 on the
built-in ``small-moe`` and PP 2 x TP 2 on ``tiny``, each 2 steps, one after the other on
one service, all SUCCEEDED.

Each one's stored plan is the plan the workers ran: every rank's reported ``Layout``
equals the stored one field by field, the stage it ran (its pp coordinate, pp
outermost) holds the layers the stored split gives that stage, every rank of a stage
ran the same partition (one digest per stage, as DMuon's dedication of a stage is
deterministic), and each step's loss is one value on every rank (the last stage's,
shared). The tiny job checkpoints (FQN-keyed: its files name the whole model's
parameters) and exports each stage's share, which together hold every parameter of the
model, each once."""

from __future__ import annotations

import dataclasses
import os

import pytest
from helpers.hf_reference import LLAMA

from service.job.layout import Layout
from service.job.models.builtin import build_model
from service.job.spec.presets import PRESETS

WORLD, STEPS = 4, 2
BASE = {"steps": STEPS, "batch_size": 2, "seq_len": 16, "global_batch_tokens": 2 * 16 * 2 * 2,
        "data": {"val_every": 0}, "export": {"enabled": False}}
JOBS = {
    "tiny": {**BASE, "name": "pp-tiny", "model": "tiny", "layout": {"pp": 2},
             "checkpoint": {"interval": 2}, "export": {"enabled": True}},
    "llama": {**BASE, "name": "pp-llama",
              "model": {"hf_arch": LLAMA["architectures"][0], "config": LLAMA},
              "layout": {"pp": 2}},
    "moe": {**BASE, "name": "pp-moe", "model": "small-moe",
            "layout": {"pp": 2, "shard": 2, "ep": 2}},
    "tp": {**BASE, "name": "pp-tp", "model": "tiny", "layout": {"pp": 2, "tp": 2}},
}


@pytest.fixture(scope="module")
def svc(shared_service):
    """The package's service (tests/system/conftest.py): 4 CPU workers, one job at a time."""
    return shared_service


@pytest.fixture(scope="module")
def jobs(svc):
    """Every job submitted at once (they queue: one runs at a time), then awaited."""
    ids = {}
    for name, spec in JOBS.items():
        status, job = svc.request("POST", "/v1/jobs", {"spec": spec})
        assert status == 201, job
        ids[name] = job["id"]
    for name, job_id in ids.items():
        done = svc.wait_ended(job_id, timeout=600)
        assert done["status"] == "SUCCEEDED", (name, svc.request(
            "GET", f"/v1/jobs/{job_id}/logs")[1])
    return ids


@pytest.mark.parametrize("name", list(JOBS))
def test_a_pp_job_runs_its_stored_layout_and_stage_split(svc, jobs, name):
    job_id = jobs[name]
    part = svc.request("GET", f"/v1/jobs/{job_id}/partition")[1]
    stored = Layout(**part["layout"])
    assert (stored.pp, stored.world_size) == (2, WORLD)
    assert stored.ep == (2 if name == "moe" else 1)
    assert stored.tp == (2 if name == "tp" else 1)
    split = {str(s["stage"]): s["layers"] for s in part["pipeline"]["stages"]}
    n = LLAMA["num_hidden_layers"] if name == "llama" else PRESETS[JOBS[name]["model"]].n_layers
    # two contiguous runs covering the model's layers, each one layer at least
    assert split["0"][0] == 0 and split["0"][1] == split["1"][0] and split["1"][1] == n
    assert all(hi > lo for lo, hi in split.values())
    records = svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1]
    assert sorted((r["step"], r["rank"]) for r in records) == \
        [(s, r) for s in range(1, STEPS + 1) for r in range(WORLD)]
    digests: dict[str, set] = {}
    for r in records:
        assert r["ran_layout"] == dataclasses.asdict(stored), (r["rank"], r["ran_layout"])
        stage = str(stored.stage_of(r["rank"]))
        assert r["coord"][0] == int(stage)
        assert r["stage_layers"] == {stage: split[stage]}
        assert r["schedule"] == "Schedule1F1B"
        digests.setdefault(stage, set()).add(r["stage_digests"][stage])
    assert sorted(digests) == ["0", "1"] and all(len(d) == 1 for d in digests.values())
    assert digests["0"] != digests["1"]
    for step in range(1, STEPS + 1):
        losses = {r["loss"] for r in records if r["step"] == step}
        assert len(losses) == 1 and next(iter(losses)) > 0, losses


def test_the_tiny_job_checkpoints_and_exports_every_stage(svc, jobs):
    from safetensors import safe_open

    runs = os.path.join(svc.env["DMUON_STORAGE"], jobs["tiny"])
    names = {n for n, _ in build_model(PRESETS["tiny"], device="meta").named_parameters()}
    shares = []
    for stage in (0, 1):
        with safe_open(os.path.join(runs, "export", f"stage-{stage}.safetensors"), "pt") as f:
            shares.append(set(f.keys()))
    assert not shares[0] & shares[1] and shares[0] | shares[1] == names
    assert "model.embed_tokens.weight" in shares[0] and "lm_head.weight" in shares[1]
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = os.path.join(runs, "dcp")
    steps = [d for d in sorted(os.listdir(ckpt)) if not d.endswith((".partial", ".old"))]
    assert len(steps) == 1, steps  # the final step, interval 2
    keys = FileSystemReader(os.path.join(ckpt, steps[0])).read_metadata().state_dict_metadata
    # FQN-keyed: every parameter of the whole model under its own name, from both stages
    assert all(any(k.endswith(n) for k in keys) for n in names), sorted(keys)[:8]
