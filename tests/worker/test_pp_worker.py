"""Pipeline-parallel jobs in the workers' loop (issue 52, item 5), without the service:
the plan a submission would store for ``layout.pp: 2`` handed to 4 gloo workers as the
driver hands it. Each worker reports the Layout it ran (equal to the stored one, field
by field), the layers of the stage it ran (the stored split), the same loss on every
rank; and the step-1 loss equals the same job's without pipeline parallelism (the
same model, seed and rows: the pipeline changes where layers run, not what they
compute), as does the gradient norm clipping measures."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers.hf_reference import LLAMA
from helpers.layouts import handed, spec_of, stored

from dmuon.testing import run
from service.control.step_records import StepRecord
from service.job.job import Job
from service.job.layout import Layout
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.make import plan_document
from service.job.spec.presets import PRESETS

HF_LLAMA = {"hf_arch": LLAMA["architectures"][0], "config": LLAMA}
FIELDS = {"steps": 2, "global_batch_tokens": 64, "dmuon": {"mode": "z2"},
          "clip_grad_norm": 1.0}


def _ran(rank, world, spec: dict, plan_json: str, root: str | None = None):
    from service.job.inputs import resolve_inputs
    from service.job.plan_document import PlanDocument
    from service.worker.loop import run_training
    from service.worker.mesh import build_mesh

    plan = PlanDocument.model_validate_json(plan_json)
    records = []
    inputs = resolve_inputs(Job.local(spec, plan).spec, root) if root else None
    run_training(Job.local(spec, plan, inputs=inputs), build_mesh(plan.layout),
                 lambda r, p: records.append(r))
    return records


def _plan(fields: dict, monkeypatch, tmp_path, workers: int = 4):
    from service.job.inputs.resolve import resolve_model

    spec = spec_of({**FIELDS, **fields})
    nodes = synthetic_inventory(1, 0, cpus_per_node=workers)
    source = resolve_model(spec, str(tmp_path))[0]
    return spec, handed(spec, stored(plan_document(spec, nodes, workers, source)), nodes,
                        monkeypatch, tmp_path, source)


@pytest.mark.parametrize("model,layout,schedule", [
    ("tiny", {"pp": 2}, "Schedule1F1B"),
    ("tiny", {"pp": 2, "pp_schedule": "gpipe"}, "ScheduleGPipe"),
    ("small-moe", {"pp": 2, "shard": 2, "ep": 2}, "Schedule1F1B"),
    ("small", {"pp": 2, "pp_schedule": "interleaved"}, "ScheduleInterleaved1F1B"),
], ids=["tiny-pp2", "tiny-pp2-gpipe", "moe-pp2-ep2", "small-pp2-interleaved"])
def test_a_pp_job_runs_the_stored_layout_and_split(model, layout, schedule, monkeypatch,
                                                   tmp_path):
    spec, plan = _plan({"model": model, "layout": layout}, monkeypatch, tmp_path)
    assert plan.layout.pp == 2 and plan.complete
    split = {s["stage"]: s["layers"] for s in plan.pipeline["stages"]}
    reports = run(_ran, spec.model_dump(mode="json"), plan.model_dump_json(),
                  world_size=plan.layout.world_size)
    for rank, records in enumerate(reports):
        assert len(records) == spec.steps
        for r in records:
            # what the control plane stores: its schema (extra fields forbidden) takes it
            StepRecord.model_validate({**r, "job_id": "pp"})
            assert Layout(**r["ran_layout"]) == plan.layout
            assert r["ran_layout"] == dataclasses.asdict(plan.layout)
            # pp rank p holds stages p, p + pp, ... (v of them)
            p, lay = plan.layout.stage_of(rank), plan.layout
            mine = range(p, lay.pp * lay.pp_stages_per_rank, lay.pp)
            assert r["stage_layers"] == {str(i): split[i] for i in mine}
            assert r["schedule"] == schedule
            # the pp bytes of all its stages (fp32): activations forward from each stage
            # but the last, their gradients backward from each but the first
            count = lay.pp * lay.pp_stages_per_rank
            act = lay.micro_batches * lay.rows_per_micro * spec.seq_len \
                * PRESETS[model].dim * 4
            assert r["bytes"].get("pp.forward", 0) == sum(i < count - 1 for i in mine) * act
            assert r["bytes"].get("pp.backward", 0) == sum(i > 0 for i in mine) * act
    for step in range(spec.steps):  # one loss per step, on every rank
        assert len({records[step]["loss"] for records in reports}) == 1
    assert reports[0][0]["loss"] > 0


def test_the_step_1_loss_is_the_same_jobs_without_pp(monkeypatch, tmp_path):
    """The step-1 loss and gradient norm, and the validation loss after each step (the
    schedule's forward-only eval, the flat job's validation_loss of the same rows)."""
    val = {"data": {"val_every": 1, "val_batches": 2}}
    spec, plan = _plan({"model": "tiny", "layout": {"pp": 2}, **val}, monkeypatch, tmp_path)
    flat_spec, flat = _plan({"model": "tiny", "layout": {"shard": 2}, **val}, monkeypatch,
                            tmp_path, 2)
    assert flat.layout.batch == plan.layout.batch and flat.layout.dp_size == 2
    pp = run(_ran, spec.model_dump(mode="json"), plan.model_dump_json(), world_size=4)
    ref = run(_ran, flat_spec.model_dump(mode="json"), flat.model_dump_json(), world_size=2)
    # without PP each rank reports its own rows' loss; the pipeline's is their mean
    mean = sum(records[0]["loss"] for records in ref) / len(ref)
    assert pp[0][0]["loss"] == pytest.approx(mean, rel=1e-5)
    assert pp[0][0]["grad_norm"] == pytest.approx(ref[0][0]["grad_norm"], rel=1e-4)
    for step in range(spec.steps):
        assert {r[step]["val_loss"] for r in pp} == {pp[0][step]["val_loss"]}
        assert pp[0][step]["val_loss"] == pytest.approx(ref[0][step]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("model", ["tiny", "hf-llama"])
def test_pp2_tp2_runs_the_stored_layout_with_the_flat_jobs_step_1_loss(model, monkeypatch,
                                                                       tmp_path):
    """TP 2 inside each of 2 stages (pp, shard 1, tp on 4 ranks): the stages pass 1/2 of
    the sequence; the step-1 loss and gradient norm are the one-rank job's of the same
    rows, and every rank reports the stored layout."""
    fields = {"model": HF_LLAMA if model == "hf-llama" else model}
    spec, plan = _plan({**fields, "layout": {"pp": 2, "tp": 2}}, monkeypatch, tmp_path)
    flat_spec, flat = _plan({**fields, "layout": {"shard": 1}}, monkeypatch, tmp_path, 1)
    assert (plan.layout.pp, plan.layout.tp, plan.layout.dp_size) == (2, 2, 1)
    assert flat.layout.batch == plan.layout.batch
    pp = run(_ran, spec.model_dump(mode="json"), plan.model_dump_json(), str(tmp_path),
             world_size=4)
    ref = run(_ran, flat_spec.model_dump(mode="json"), flat.model_dump_json(), str(tmp_path),
              world_size=1)
    for rank, records in enumerate(pp):
        assert [Layout(**r["ran_layout"]) for r in records] == [plan.layout] * spec.steps
        assert records[0]["loss"] == pytest.approx(ref[0][0]["loss"], rel=1e-5), rank
        assert records[0]["grad_norm"] == pytest.approx(ref[0][0]["grad_norm"], rel=1e-4)


def test_a_pp_job_starts_from_model_weights_as_the_flat_job_does(monkeypatch, tmp_path):
    """``model.weights`` under PP 2 (HF Llama): each stage loads its keys, so the step-1
    loss is the one-rank job's from the same safetensors (and not a fresh
    initialisation's)."""
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    for p in model.parameters():  # far from the built-in init, so a missed load shows
        p.data.uniform_(-0.2, 0.2)
    os.makedirs(tmp_path / "start")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "start" / "model.safetensors"))
    losses = {}
    for name, layout, workers, weights in (("pp", {"pp": 2}, 4, True),
                                           ("flat", {"shard": 1}, 1, True),
                                           ("fresh", {"shard": 1}, 1, False)):
        model_field = {**HF_LLAMA, **({"weights": "start"} if weights else {})}
        spec, plan = _plan({"model": model_field, "layout": layout}, monkeypatch, tmp_path,
                           workers)
        reports = run(_ran, spec.model_dump(mode="json"), plan.model_dump_json(),
                      str(tmp_path), world_size=workers)
        losses[name] = reports[0][0]["loss"]
    assert losses["pp"] == pytest.approx(losses["flat"], rel=1e-5)
    assert losses["flat"] != pytest.approx(losses["fresh"], rel=1e-2)


def _resumed(rank, world, spec: dict, plan_json: str, ckpt: str):
    from service.job.plan_document import PlanDocument
    from service.worker.loop import run_training
    from service.worker.mesh import build_mesh

    plan = PlanDocument.model_validate_json(plan_json)
    records = []
    run_training(Job.local(spec, plan, checkpoint_dir=ckpt), build_mesh(plan.layout),
                 lambda r, p: records.append(r))
    return [(r["step"], r["loss"], r["resumed_from"]) for r in records]


def test_a_pp_job_resumes_from_its_fqn_keyed_checkpoint(monkeypatch, tmp_path):
    """3 steps checkpointed each step; the last checkpoint removed, the same job run
    again resumes from step 2 and its step 3 has the uninterrupted run's loss (the
    params, the momentum and the step all came back)."""
    import shutil

    from service.job.job_dir import step_dir

    spec, plan = _plan({"model": "tiny", "layout": {"pp": 2}, "steps": 3,
                        "checkpoint": {"interval": 1, "keep_last": 3}}, monkeypatch, tmp_path)
    ckpt = str(tmp_path / "dcp")
    args = (spec.model_dump(mode="json"), plan.model_dump_json(), ckpt)
    first = run(_resumed, *args, world_size=4)
    assert [s for s, _, _ in first[0]] == [1, 2, 3]
    shutil.rmtree(tmp_path / "dcp" / step_dir(3))
    again = run(_resumed, *args, world_size=4)
    for rank in range(4):
        assert [(s, r) for s, _, r in again[rank]] == [(3, 2)]
        assert again[rank][0][1] == pytest.approx(first[rank][2][1], rel=1e-6)


def _exported(rank, world, spec: dict, plan_json: str, ckpt: str, out: str, only: bool):
    from service.job.plan_document import PlanDocument
    from service.worker.loop import run_training
    from service.worker.mesh import build_mesh

    plan = PlanDocument.model_validate_json(plan_json)
    job = Job.local(spec, plan, checkpoint_dir=ckpt, export_dir=out, export_only=only)
    run_training(job, build_mesh(plan.layout), lambda r, p: None)


def test_a_pp_jobs_export_is_each_stages_share_and_export_only_rewrites_it(
        monkeypatch, tmp_path):
    """The end of training writes stage-<i>.safetensors, every parameter of the model
    once by its FQN; an export-only run from the final checkpoint writes the same
    tensors."""
    from safetensors.torch import load_file

    from service.job.models.builtin import build_model
    from service.job.spec.presets import PRESETS

    spec, plan = _plan({"model": "tiny", "layout": {"pp": 2}, "export": {"enabled": True},
                        "checkpoint": {"interval": 2}}, monkeypatch, tmp_path)
    ckpt = str(tmp_path / "dcp")
    common = (spec.model_dump(mode="json"), plan.model_dump_json(), ckpt)
    run(_exported, *common, str(tmp_path / "end"), False, world_size=4)
    run(_exported, *common, str(tmp_path / "again"), True, world_size=4)
    names = {n for n, _ in build_model(PRESETS["tiny"], device="meta").named_parameters()}
    end = [load_file(str(tmp_path / "end" / f"stage-{i}.safetensors")) for i in (0, 1)]
    again = [load_file(str(tmp_path / "again" / f"stage-{i}.safetensors")) for i in (0, 1)]
    assert not set(end[0]) & set(end[1]) and set(end[0]) | set(end[1]) == names
    for a, b in zip(end, again):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
