"""Real workloads end to end, on one control plane with its own local Ray head (4 CPU
workers, gloo on loopback):

- tiny Hugging Face LlamaForCausalLM (config.json under the data root, ``layout: {tp:
  2}``: 1 x 2 x 2, tensor parallel inside the node) and Qwen3MoeForCausalLM (2 x 2
  HSDP, fused 3-D experts, config inline, activation checkpointing per block) through
  REST, 10 steps in float64 with warmup+cosine, clipping and accumulation: every
  exported parameter within 1e-9 of the single-process reference
  (tests/helpers/hf_reference.py), and the stored plan's layout the one the workers ran;
- ``dmuon-svc export JOB`` rewrites the export from the newest checkpoint;
- a user's model by import path from a working_dir, through ``ray job submit`` and
  through REST (``dmuon-svc submit --working-dir`` uploads the directory);
- an elastic job whose smallest layout the head cannot hold fails once it has waited
  ``layout.elastic.max_wait_s``, naming both counts (Ray Train alone waits for ever);
- NorMuon with QK-clip on the HF Llama under TP through REST, its records carrying the
  max logit and the heads clipped;
- bad paths and sizes refused with their field path before anything is stored;
- Ctrl-C stops the service, its running job as a cancel would, and every process of
  its head.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from helpers.elastic import SPEC as ELASTIC
from helpers.hf_reference import LLAMA, QWEN3_MOE, RECIPE, lr_factor, reference_run
from helpers.paths import TESTS as HERE
from helpers.service_http import alive, head_processes

from service.control.ray_head import STATE_FILE
from service.job.inputs.shards import write_shard

USER_DIR = os.path.join(HERE, "data", "user_model")
WORLD = 4


@pytest.fixture(scope="module")
def svc(shared_service):
    """The package's service (tests/system/conftest.py: 4 CPU workers, one job at a
    time), with the Llama's config.json under its data root."""
    data = os.path.join(shared_service.env["DMUON_STORAGE"], "data")
    os.makedirs(os.path.join(data, "models", "llama"), exist_ok=True)
    with open(os.path.join(data, "models", "llama", "config.json"), "w") as fh:
        json.dump(LLAMA, fh)
    shared_service.data = data
    return shared_service


def _exported(svc, job_id) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in glob.glob(os.path.join(svc.env["DMUON_STORAGE"], job_id, "export",
                                       "*.safetensors")):
        out.update(load_file(path))
    return out


def _cli(svc, *args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "service.control.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "DMUON_URL": svc.url, "DMUON_API_TOKEN": svc.token})


JOBS: dict[str, str] = {}


# the Llama job runs tensor parallel: R x N x T = 1 x 2 x 2, chosen by the planner; the
# MoE job as HSDP 2 x 2, its experts whole (EP 1) or split over EP 2 (2 of 4 each)
LAYOUTS = {"llama": {"tp": 2}, "qwen3_moe": RECIPE["layout"],
           "qwen3_moe_ep": {**RECIPE["layout"], "ep": 2}}


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen3_moe_ep"])
def test_hf_models_through_rest_match_the_reference(svc, name):
    config = LLAMA if name == "llama" else QWEN3_MOE
    model = ({"hf": "models/llama"} if name == "llama" else
             {"hf_arch": "Qwen3MoeForCausalLM", "config": QWEN3_MOE})
    # per-block activation checkpointing changes no arithmetic: the MoE job runs with it
    checkpointing = "none" if name == "llama" else "non_reentrant"
    layout = LAYOUTS[name]
    status, job = svc.request("POST", "/v1/jobs", {"spec": {
        **RECIPE, "name": name, "model": model, "activation_checkpointing": checkpointing,
        "checkpoint": {"interval": 4, "keep_last": 1}, "layout": layout}})
    assert status == 201, job
    JOBS[name] = job["id"]
    done = svc.wait_ended(job["id"])
    assert done["status"] == "SUCCEEDED", svc.request("GET", f"/v1/jobs/{job['id']}/logs")[1]
    got, want = _exported(svc, job["id"]), reference_run(config)
    assert set(got) == set(want)
    if name == "llama":  # the export is what transformers loads
        import transformers

        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(svc.env["DMUON_STORAGE"], job["id"], "export"), dtype=torch.float64)
        assert all(torch.equal(t, got[k]) for k, t in loaded.state_dict().items())
    for key, value in want.items():
        error = ((got[key] - value).abs().max() / value.abs().max()).item()
        assert error <= 1e-9, (key, error)
    dcp = os.path.join(svc.env["DMUON_STORAGE"], job["id"], "dcp")
    assert sorted(os.listdir(dcp)) == ["step_000010"]  # every 4, the last kept, the final
    part = _ran_the_stored_partition(svc, job["id"])
    groups = part["optimizer_split"]
    assert set(groups["muon"]) | set(groups["adamw"]) == set(want)
    assert {k for k in want if ".layers." in k and want[k].ndim >= 2
            and not k.endswith("mlp.gate.weight")} == set(groups["muon"])
    records = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert len(records) == RECIPE["steps"] * WORLD
    stored = part["layout"]
    planned = (1, 2, 2) if name == "llama" else (2, 2, 1)  # R x N x T
    assert (stored["replicate"], stored["shard"], stored["tp"]) == planned
    assert stored["ep"] == part["ep_size"] == layout.get("ep", 1)
    if layout.get("ep", 1) > 1:  # every rank sent tokens to its EP peer, at every step
        assert all(r["bytes"]["ep.forward"] > 0 and r["bytes"]["ep.backward"] > 0
                   for r in records)
    # the workers ran the stored layout: R x N x T under TP, else R x N
    assert {tuple(r["layout"]) for r in records} == {planned if planned[2] > 1 else planned[:2]}
    assert len({tuple(r["coord"]) for r in records}) == WORLD
    data_parallel = planned[0] * planned[1]  # a TP group's ranks share their tokens
    s = RECIPE["schedule"]
    for r in records:
        factor = lr_factor(r["step"] - 1, RECIPE["steps"], s["warmup_steps"], s["min_lr_ratio"])
        assert r["lr"]["muon"] == pytest.approx(RECIPE["optimizer"]["lr"] * factor, rel=1e-12)
        assert r["lr"]["adamw"] == pytest.approx(RECIPE["optimizer"]["adamw_lr"] * factor,
                                                 rel=1e-12)
        assert r["tokens_per_s_total"] == pytest.approx(data_parallel * r["tokens_per_s"],
                                                        rel=1e-12)
        assert r["grad_norm"] > 0 and r["mfu"] is None  # no peak on a CPU


def test_export_command_rewrites_the_export_from_the_checkpoint(svc):
    job_id = JOBS["llama"]
    before = _exported(svc, job_id)
    shutil.rmtree(os.path.join(svc.env["DMUON_STORAGE"], job_id, "export"))
    proc = _cli(svc, "export", job_id)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = _exported(svc, job_id)
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


def _spec_of_user_job() -> dict:
    import yaml

    with open(os.path.join(USER_DIR, "job.yaml")) as fh:
        return yaml.safe_load(fh)


def _user_model_split(plan: dict, wrapped: str = "") -> None:
    groups = plan["optimizer_split"]
    assert sorted(groups["muon"]) == sorted(
        f"transformer.h.{i}.{wrapped}{m}.weight" for i in range(2)
        for m in ("attn.c_attn", "attn.c_proj", "c_fc", "c_proj"))
    assert groups["adamw_why"]["transformer.wte.weight"] == "outside the repeated blocks"
    assert groups["adamw_why"][f"transformer.h.0.{wrapped}c_fc.bias"] == "1-D"


def _digest(part: dict) -> str:
    """Who owns what on which mesh, hashed here as the workers report it."""
    import hashlib

    units = {u: [a["owner"], list(a["shape"]), a["boundary"]] for u, a in part["params"].items()}
    ep = [part["ep_size"]] if part.get("ep_size", 1) > 1 else []  # EP 1 as before EP
    text = json.dumps([part["replicate_size"], part["shard_size"], units, *ep],
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _ran_the_stored_partition(svc, job_id: str) -> dict:
    """The stored partition, read back from the store, after checking that every rank's
    every step ran it."""
    part = svc.request("GET", f"/v1/jobs/{job_id}/partition")[1]
    records = svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1]
    assert records and {r["partition_digest"] for r in records} == {_digest(part)}, job_id
    return part


def _ray_submit(svc, args: list[str]) -> subprocess.CompletedProcess:
    """``ray job submit`` of the entrypoint with the user model's directory."""
    with open(os.path.join(svc.env["DMUON_STORAGE"], STATE_FILE)) as fh:
        dashboard = f"http://127.0.0.1:{json.load(fh)['dashboard_port']}"
    env = {"working_dir": USER_DIR, "env_vars": {"GLOO_SOCKET_IFNAME": "lo",
                                                 "OMP_NUM_THREADS": "1"}}
    return subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "ray"), "job", "submit", "--address",
         dashboard, "--runtime-env-json", json.dumps(env), "--", sys.executable, "-m",
         "service.driver.job_driver", *args], capture_output=True, text=True, timeout=400,
        env={**os.environ, "RAY_ADDRESS": ""})


def test_user_model_by_ray_job_submit(svc):
    storage = os.path.join(svc.root, "submitted")
    proc = _ray_submit(svc, ["--spec", "job.yaml", "--storage", storage,
                             "--job-id", "by-ray-submit"])
    assert proc.returncode == 0 and '"status": "SUCCEEDED"' in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(storage, "by-ray-submit", "plan.json")) as fh:
        _user_model_split(json.load(fh))
    assert os.path.isfile(os.path.join(storage, "by-ray-submit", "export", "config.json"))


WRAPPED = "_checkpoint_wrapped_module."  # checkpoint_wrapper's child


def test_user_model_through_rest_with_an_uploaded_working_dir(svc):
    """A factory the service cannot import, with activation checkpointing (which renames
    its params): the job's entrypoint plans it once, the store keeps that plan, and the
    workers run exactly it."""
    proc = _cli(svc, "submit", "job_checkpointed.yaml", "--working-dir", ".", cwd=USER_DIR)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split()[0]
    done = svc.wait_ended(job_id)
    assert done["status"] == "SUCCEEDED", svc.request("GET", f"/v1/jobs/{job_id}/logs")[1]
    part = _ran_the_stored_partition(svc, job_id)
    _user_model_split(part, WRAPPED)  # the plan the job completed, stored back
    assert part["completed_by"] == "driver" and part["deferred"] is None
    assert part["params"] and part["modes"]["dmuon"] == "z3"
    assert all(WRAPPED in unit for unit in part["params"])
    JOBS["user"] = job_id
    sys.path.insert(0, USER_DIR)
    try:
        from mymodels.gpt import build
    finally:
        sys.path.remove(USER_DIR)
    model, spec = build(dim=32, layers=2), _spec_of_user_job()
    dense = sum(p.numel() for n, p in model.named_parameters() if "wte" not in n and "wpe" not in n)
    flops = 6 * dense + 12 * 2 * 32 * spec["seq_len"]  # PaLM's count, written out
    for r in svc.request("GET", f"/v1/jobs/{job_id}/metrics")[1]:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / 1e12, rel=1e-9)
    bad = svc.request("POST", "/v1/jobs", {"spec": {**spec, "working_dir": "pkg-" + "0" * 32}})
    assert bad[0] == 422 and bad[1]["detail"][0]["field"] == "spec.working_dir", bad


def test_a_plan_that_no_longer_matches_the_model_is_refused_naming_the_param(svc):
    """The user job's stored plan with its units renamed as a plan made without activation
    checkpointing would name them: the plan is checked once where it is made, so the
    workers' ``dedicate_params(plan=...)`` refuses it, before any collective and any
    step (tests/core/test_stored_plan.py), and the job's reason names the first param
    that differs (issue 51: the driver no longer builds the model a third time)."""
    with open(os.path.join(svc.env["DMUON_STORAGE"], JOBS["user"], "plan.json")) as fh:
        plan = json.load(fh)
    params = plan["partition"]["params"]
    plan["partition"]["params"] = {u.replace(WRAPPED, ""): {**a, "param": a["param"].replace(
        WRAPPED, "")} for u, a in params.items()}
    edited, storage = os.path.join(svc.root, "edited_plan.json"), os.path.join(svc.root, "ed")
    with open(edited, "w") as fh:
        json.dump(plan, fh)
    # on the service's head, idle between this module's jobs: no Ray of its own to start
    head = f"127.0.0.1:{svc.head()['port']}"
    proc = subprocess.run(
        [sys.executable, "-m", "service.driver.job_driver", "--spec", "job_checkpointed.yaml",
         "--plan", edited, "--storage", storage, "--job-id", "edited"], cwd=USER_DIR,
        capture_output=True, text=True, timeout=300, env={**os.environ, "RAY_ADDRESS": head})
    first = next(iter(params))
    message = (f"the plan does not match the model: '{first.replace(WRAPPED, '')}' is in the "
               f"plan but is no Muon-target param of this model (the model has '{first}' "
               "there)")
    assert proc.returncode == 1, proc.stderr[-2000:]
    with open(os.path.join(storage, "edited", "failure.json")) as fh:
        reason = json.load(fh)
    assert reason["type"] == "PlanMismatch" and message in reason["message"], reason
    assert reason["source"] == "worker" and reason["phase"] == "setup", reason
    assert not os.path.exists(os.path.join(storage, "edited", "metrics.jsonl"))


def test_an_elastic_job_below_its_smallest_layout_fails_after_max_wait_s(svc):
    """At least 3 nodes of 2 workers, on a head that holds 4 workers: the job waits for
    capacity, then fails with a reason that names what the cluster holds and what the
    smallest layout needs; no step ran."""
    layout = {**ELASTIC["layout"], "elastic": {"min_nodes": 3, "max_nodes": 3,
                                               "max_wait_s": 3}}
    status, job = svc.request("POST", "/v1/jobs", {"spec": {**ELASTIC, "name": "short",
                                                            "layout": layout}})
    assert status == 201, job
    done = svc.wait_ended(job["id"], timeout=240)
    reason = done["reason"]
    assert done["status"] == "FAILED" and reason["type"] == "CapacityTimeout", reason
    assert (reason["rank"], reason["step"], reason["source"]) == (None, None, "controller")
    message = re.fullmatch(r"waited (\d+) s for capacity \(layout.elastic.max_wait_s = 3\): "
                           r"the cluster holds (\d+) worker\(s\) of \{'CPU': 1(?:\.0)?\}; "
                           r"the smallest layout the plan runs, 3 x 2, needs 6",
                           reason["message"])
    assert message and int(message[1]) >= 3 and int(message[2]) == WORLD, reason["message"]
    assert svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1] == []


def test_normuon_and_qk_clip_through_rest_record_the_max_logits(svc):
    """NorMuon with QK-clip on the HF Llama (recording through transformers' attention
    interface), tensor parallel 1 x 2 x 2 (each TP rank records its own heads), with a
    tau under every head's max logit: SUCCEEDED, and each step's records, the same on
    every rank, carry the largest max logit (over tau) and the heads clipped (some, at
    most the model's 2 x 4). The numbers: tests/job/test_qk_clip_hf.py, core/test_normuon.py."""
    tau, steps, heads = 0.01, 3, LLAMA["num_hidden_layers"] * LLAMA["num_attention_heads"]
    status, job = svc.request("POST", "/v1/jobs", {"spec": {
        **RECIPE, "name": "variants", "steps": steps, "model": {"hf": "models/llama"},
        "layout": {"tp": 2}, "optimizer": {**RECIPE["optimizer"], "variant": "normuon",
                                           "qk_clip": {"tau": tau}}}})
    assert status == 201, job
    done = svc.wait_ended(job["id"])
    assert done["status"] == "SUCCEEDED", svc.request("GET", f"/v1/jobs/{job['id']}/logs")[1]
    records = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    assert sorted(r["step"] for r in records) == sorted(list(range(1, steps + 1)) * WORLD)
    for step in range(1, steps + 1):
        seen = {(r["max_logit"], r["clipped_heads"]) for r in records if r["step"] == step}
        assert len(seen) == 1, (step, seen)
        max_logit, clipped = seen.pop()
        assert max_logit > tau and 0 < clipped <= heads, (step, max_logit, clipped)


def test_the_builtin_moe_with_ep2_runs_the_stored_plan_and_moves_its_ep_bytes(svc):
    """``model: small-moe`` as EP 2 x expert shard 2 through REST: SUCCEEDED on the stored
    partition, and at every step the ``ep`` bytes the ranks counted, summed over them,
    are the planner's (what one rank receives depends on the routing; what all receive
    is what all sent). The numbers: tests/job/test_ep_plan.py, core/test_expert_parallel.py."""
    steps = 3
    status, job = svc.request("POST", "/v1/jobs", {"spec": {
        **RECIPE, "name": "moe-ep", "model": "small-moe", "steps": steps,
        "layout": {"replicate": 1, "shard": WORLD, "ep": 2}}})
    assert status == 201, job
    done = svc.wait_ended(job["id"])
    assert done["status"] == "SUCCEEDED", svc.request("GET", f"/v1/jobs/{job['id']}/logs")[1]
    part = _ran_the_stored_partition(svc, job["id"])
    assert part["layout"]["ep"] == part["ep_size"] == 2
    records = svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]
    for step in range(1, steps + 1):
        mine = [r for r in records if r["step"] == step]
        assert len(mine) == WORLD, step
        for phase in ("forward", "backward"):
            got = sum(r["bytes"][f"ep.{phase}"] for r in mine)
            want = sum(rank["ledger"]["ep"][phase] for rank in part["ranks"])
            assert got == pytest.approx(want, rel=1e-12), (step, phase)


def _bad_specs(data: str) -> list[tuple[dict, str]]:
    os.makedirs(os.path.join(data, "bad"), exist_ok=True)
    write_shard(os.path.join(data, "bad", "empty.bin"), np.zeros(0, np.uint16))
    write_shard(os.path.join(data, "bad", "big_ids.bin"), np.full(4096, 300, np.uint16))
    np.arange(100, dtype=np.uint16).tofile(os.path.join(data, "bad", "raw.bin"))
    base = {"model": "tiny", "seq_len": 32}
    return [
        ({**base, "data": {"source": "nowhere/*.bin"}}, "spec.data.source"),
        ({**base, "data": {"source": "bad/empty.bin"}}, "spec.data.source"),
        ({**base, "data": {"source": "bad/big_ids.bin"}}, "spec.data.source"),  # vocab 301
        ({**base, "data": {"source": "bad/raw.bin"}}, "spec.data.source"),  # no dtype
        ({**base, "data": {"source": "bad/raw.bin", "dtype": "uint16"}},
         "spec.data.val_fraction"),  # 100 tokens: 5 held out, no window of 33
        ({**base, "data": {"source": "bad/big_ids.bin", "val_source": "none/*.bin"}},
         "spec.data.val_source"),
        ({"model": {"hf": "models/llama"}, "seq_len": 128}, "spec.seq_len"),  # limit 64
        ({"model": {"hf": "models/missing"}}, "spec.model.hf"),
        ({"model": {"hf": "models/llama", "weights": "models"}}, "spec.model.weights"),
        ({"model": {"hf_arch": "Qwen3MoeForCausalLM", "config": QWEN3_MOE},
          "optimizer": {"qk_clip": {"tau": 100}}}, "spec.optimizer.qk_clip"),  # q/k norms
        ({"model": {"hf_arch": "Qwen3MoeForCausalLM", "config": QWEN3_MOE},
          "layout": {"shard": 4, "ep": 8}}, "spec.layout.ep"),  # 4 experts; N = 4
        ({"model": {"hf_arch": "Qwen3MoeForCausalLM", "config": QWEN3_MOE},
          "layout": {"replicate": 2, "shard": 2, "ep": 4}}, "spec.layout.ep"),  # N = 2
        ({**base, "layout": {"ep": 2}}, "spec.layout.ep"),  # a dense model
        ({**base, "model": "tiny", "dmuon": {"muon_params": r"lm_head\.weight"}},
         "spec.dmuon.muon_params"),
        ({**base, "batch_size": 2, "global_batch_tokens": 300}, "spec.global_batch_tokens"),
    ]


def test_bad_paths_and_sizes_are_refused_naming_the_field(svc):
    stored = len(svc.request("GET", "/v1/jobs")[1])
    for spec, field in _bad_specs(svc.data):
        status, body = svc.request("POST", "/v1/jobs", {"spec": spec})
        assert status == 422, (spec, body)
        assert [d["field"] for d in body["detail"]] == [field], (spec, body)
    assert len(svc.request("GET", "/v1/jobs")[1]) == stored  # nothing stored


def test_ctrl_c_stops_the_service_and_every_process_of_its_head(svc):
    """Last in this module: Ctrl-C (SIGINT) to dmuon-serve, restarted here with its
    standard error in a file, while a job with MLflow and W&B runs: exit 0, no
    traceback, the job STOPPED as on a cancel (its MLflow run KILLED with an end time,
    its W&B run with its exit record, read back with their own tools), none of the
    head's processes left (by PID), its temp dir and the record gone. (SIGTERM, and
    --keep-ray: tests/system/test_app_ray.py.)"""
    from helpers.tracking import mlflow_run, wandb_run

    from service.control.store import JobStore

    svc.kill()
    stderr = os.path.join(svc.root, "serve.stderr")
    svc.start(stderr=stderr)
    head = svc.head()
    processes = head_processes(head)
    assert head["pid"] in processes and len(processes) > 5
    uri = f"sqlite:///{svc.root}/mlflow.db"
    status, job = svc.request("POST", "/v1/jobs", {"spec": {
        "name": "interrupted", "model": "tiny", "steps": 400, "batch_size": 4,
        "seq_len": 32, "layout": {"replicate": 2, "shard": 2},
        "metrics": {"mlflow": {"tracking_uri": uri}, "wandb": {"mode": "offline"}}}})
    assert status == 201, job
    deadline = time.time() + 240
    while not svc.request("GET", f"/v1/jobs/{job['id']}/metrics")[1]:
        assert time.time() < deadline, svc.request("GET", f"/v1/jobs/{job['id']}")[1]
        time.sleep(0.5)
    assert svc.signalled(signal.SIGINT, timeout=120) == 0
    with open(stderr) as fh:
        err = fh.read()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert alive(processes) == set()
    assert not os.path.exists(os.path.join(svc.env["DMUON_STORAGE"], STATE_FILE))
    assert not os.path.exists(head["temp_dir"])
    store = JobStore(f"sqlite:///{svc.env['DMUON_DB']}")
    try:
        assert store.get_job(job["id"])["status"] == "STOPPED"
    finally:
        store.close()
    run, _ = mlflow_run(uri, job["id"])
    assert run.info.status == "KILLED" and run.info.end_time >= run.info.start_time
    records, _ = wandb_run(os.path.join(svc.env["DMUON_STORAGE"], job["id"]))
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [130]
