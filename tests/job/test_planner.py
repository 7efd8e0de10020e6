"""Job spec validation and the placement planner (no Ray needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from service.job.plan.inventory import synthetic_inventory
from service.job.plan.layout_choice import PlacementError
from service.job.plan.predict import predict
from service.job.spec import SpecError, parse_spec

GPU = {"resources_per_worker": {"CPU": 1, "GPU": 1}}


@pytest.mark.parametrize("data,path", [
    ({"steps": -3}, "steps"),
    ({"model": "llama9-1t"}, "model"),
    ({"optimizer": {"lr": 0.1, "bogus": 1}}, "optimizer.bogus"),
    ({"optimizer": {"ns_dtype": "int8"}}, "optimizer.ns_dtype"),
    ({"layout": {"nodes": 0}}, "layout.nodes"),
    ({"surprise": True}, "surprise"),
])
def test_bad_specs_name_the_field(data, path):
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert f"{path}:" in str(e.value)


def test_entrypoint_refuses_bad_spec_before_starting_anything(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("model: tiny\nsteps: -1\n")
    proc = subprocess.run([sys.executable, "-m", "service.driver.job_driver", "--spec", str(spec)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "steps:" in proc.stderr
    assert "Started a local Ray" not in proc.stderr


@pytest.mark.parametrize("layout,nodes,cpus,reason", [
    ({"replicate": 1, "shard": 7}, 2, 4, "cannot be split evenly"),
    ({"nodes": 2, "workers_per_node": 4}, 2, 2, "fits only 2 workers"),
    ({"nodes": 3}, 2, 4, "only 2 nodes"),
])
def test_impossible_layouts_are_refused_with_the_reason(layout, nodes, cpus, reason):
    spec = parse_spec({"model": "tiny", "layout": layout})
    with pytest.raises(PlacementError, match=reason):
        predict(spec, synthetic_inventory(nodes, 0, cpus_per_node=cpus))


def test_more_workers_than_logical_cpus_is_refused():
    spec = parse_spec({"model": "tiny", "layout": {"nodes": 1, "workers_per_node": 4},
                       "resources_per_worker": {"CPU": 2}})
    with pytest.raises(PlacementError, match="fits only 2 workers"):
        predict(spec, synthetic_inventory(1, 0, cpus_per_node=4))


def _llama_matrices(name):
    from service.job.models.builtin import get_config

    c = get_config(name)
    kv = c.n_kv_heads * c.dim // c.n_heads
    per_layer = 2 * c.dim * c.dim + 2 * kv * c.dim + 3 * c.ffn_dim * c.dim
    return c.n_layers * per_layer, per_layer


@pytest.mark.parametrize("model", ["llama3-8b", "llama3-70b"])
@pytest.mark.parametrize("nodes", [1, 2, 8, 16])
def test_planner_bytes_follow_the_seed_formulas(model, nodes):
    p_m, layer = _llama_matrices(model)
    elt = 2  # bfloat16
    for mode, passes in (("z2", 2), ("z3", 3)):
        spec = parse_spec({"model": model, "precision": "bfloat16", "dmuon": {"mode": mode},
                           "clip_grad_norm": None,  # its all-reduce: tests/job/test_modes.py
                           **GPU})
        placement = predict(spec, synthetic_inventory(nodes, 8))
        assert (placement.layout.replicate, placement.layout.shard) == (nodes, 8)
        units = len(placement.plan.params)
        for rank in (placement.ranks[0], placement.ranks[-1]):
            shard = sum(v for k, v in rank.ledger["shard"].items() if k != "step")
            assert shard == passes * 7 * p_m * elt / 8  # 2 or 3 (N-1)/N x P_M x elt
            # the step's flags: gradient presence per unit, non-finite per rank and FSDP2's,
            # and the orthogonalised updates' after NS
            flags = units + nodes * 8 + 1 + 1
            assert rank.ledger["shard"]["step"] == 2 * 7 * flags * 4 / 8
            assert rank.memory["packed_buffers"] == (p_m * elt if mode == "z2" else 0)
            # Z3: the running layer and the one prefetched
            assert rank.packed_peak == (p_m * elt if mode == "z2" else 2 * layer * elt)
        # the packed peak's column names the mode it is the peak of
        assert "Z2 packed GB" in placement.table()
        assert f"peak GB ({mode.upper()})" in placement.table()


def _plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "service.job.plan", *args],
                          capture_output=True, text=True, timeout=300)


def test_planner_cli_says_it_fits_first():
    proc = _plan_cli("--model", "llama3-8b", "--nodes", "1", "--mode", "auto")
    assert proc.returncode == 0, proc.stderr
    first, *rest = proc.stdout.splitlines()
    assert first.startswith("fits: peak ") and "of 80 GB per rank" in first, first
    assert rest[0].startswith("layout 1 x 8 (replicate x shard) on 1 node;")  # no "1 nodes"


def test_planner_cli_says_a_layout_does_not_fit_and_the_smallest_that_does():
    proc = _plan_cli("--model", "llama3-70b", "--nodes", "8", "--gpus-per-node", "8",
                     "--mode", "auto")
    assert proc.returncode == 1, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("does not fit: peak 230.8 GB of 80 GB per rank (Z3"), first
    assert first.endswith("the smallest layout that fits is 8 nodes x 8 GPUs with --tp 8 "
                          "(layout 8 x 1 x 8, Z3, peak 58.8 GB)"), first
    assert "layout 8 x 8 (replicate x shard) on 8 nodes" in proc.stdout
    assert "even Z3 needs 230.8 GB" in proc.stdout  # the tree's step 2, after "> 10B"


def test_planner_cli_says_when_no_layout_fits():
    proc = _plan_cli("--model", "llama3-8b", "--gpus-per-node", "1", "--batch-size", "64")
    assert proc.returncode == 1, proc.stderr
    assert "no layout fits on up to 256 nodes x 1 GPU " in proc.stdout.splitlines()[0]


def test_planner_defaults_plan_every_model_it_names():
    """small-moe's 256-token limit, not the 8192 default the others take."""
    proc = _plan_cli("--model", "small-moe", "--nodes", "8", "--ep", "8")
    assert proc.returncode == 0, proc.stderr
    assert "layout 8 x 8, ep 8" in proc.stdout
    assert _plan_cli("--model", "no-such-model").returncode == 2


def test_planner_takes_a_hugging_face_config(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64}))
    for where in (tmp_path, tmp_path / "config.json"):
        proc = _plan_cli("--model", str(where), "--nodes", "1", "--gpus-per-node", "2")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("fits: ") and "layout 1 x 2" in proc.stdout


def test_the_records_moe_shapes_are_the_planners():
    from bench import ep_plan
    from service.job.plan.moe_shapes import MOE_SHAPES

    assert ep_plan.MODELS is MOE_SHAPES
    assert {"qwen3-30b-a3b", "kimi-k2-shape"} <= set(MOE_SHAPES)


@pytest.mark.parametrize("module", ["service.job.plan", "service.driver.job_driver",
                                    "service.job.inputs.prepare"])
def test_help_names_the_program_as_it_is_run(module):
    """Not ``usage: __main__.py``."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith(f"usage: python -m {module} "), proc.stdout


def _measure(rank, world, spec_data):
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from service.job.models.builtin import causal_lm_loss
    from service.worker.corpus import batch_at, load_corpus
    from service.worker.loop import build_training

    spec = parse_spec(spec_data)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt, _ = build_training(spec, mesh)
    corpus = load_corpus("train", max_bytes=200_000)
    for step in range(2):
        rows = batch_at(corpus, step, spec.batch_size * world, spec.seq_len)
        rows = rows[rank * spec.batch_size:(rank + 1) * spec.batch_size]
        causal_lm_loss(model(rows[:, :-1]), rows[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return dmuon.memory_report(model, opt), dmuon.get_ledger(model).last_step_by_phase()


@pytest.mark.parametrize("mode,variant,model", [
    ("z2", "muon", "tiny"), ("z3", "muon", "tiny"), ("z3", "normuon", "tiny"),
    ("z3", "normuon", "small-moe")])  # NorMuon's rows of slices of experts too
def test_predictions_equal_what_workers_measure(mode, variant, model):
    """Muon's momentum, and NorMuon's row moments with it, as predicted and measured."""
    from dmuon.testing import run

    data = {"model": model, "precision": "float64", "dmuon": {"mode": mode},
            "optimizer": {"variant": variant},
            "clip_grad_norm": None,  # this loop leaves clipping out (tests/job/test_modes.py)
            "layout": {"replicate": 2, "shard": 2}, "batch_size": 2, "seq_len": 16}
    placement = predict(parse_spec(data), synthetic_inventory(1, 0, cpus_per_node=4))
    for rank, (memory, ledger) in enumerate(run(_measure, data)):
        predicted = placement.ranks[rank]
        assert memory == predicted.memory, rank
        assert ledger == predicted.ledger, rank


# the spec names dtypes; dmuon.Muon takes torch dtypes (service.job.models.dtypes maps them)
def _as_spec_default(value):
    import torch

    from service.job.models.dtypes import DTYPES

    names = {dtype: name for name, dtype in DTYPES.items()}
    return names[value] if isinstance(value, torch.dtype) else value


def test_optimizer_section_is_exactly_dmuon_muons_options():
    """Names and defaults, read from dmuon.Muon's signature (its first positional
    parameter, the model, aside): a new or changed Muon option fails here until the spec
    follows it."""
    import inspect

    import dmuon
    from service.job.spec import OptimizerSpec

    params = list(inspect.signature(dmuon.Muon).parameters.values())[1:]
    # named param groups hold the model's param objects: code, not a job spec
    muon = {p.name: _as_spec_default(p.default) for p in params if p.name != "param_groups"}
    spec = {name: field.get_default(call_default_factory=True)
            for name, field in OptimizerSpec.model_fields.items()}
    assert spec == muon


def test_the_spec_maps_onto_muons_call():
    import inspect

    import torch

    import dmuon
    from service.job.models.dtypes import muon_kwargs

    spec = parse_spec({"model": "tiny", "optimizer": {"ns_dtype": "float64",
                                                      "adamw_betas": [0.8, 0.9],
                                                      "variant": "normuon", "beta2": 0.9}})
    kwargs = muon_kwargs(spec.optimizer)
    assert kwargs["ns_dtype"] is torch.float64 and kwargs["ns_gram_dtype"] is None
    assert kwargs["adamw_betas"] == (0.8, 0.9)
    assert (kwargs["variant"], kwargs["beta2"]) == ("normuon", 0.9)
    inspect.signature(dmuon.Muon).bind(torch.nn.Linear(2, 2), **kwargs)  # every name fits


def test_the_dashboard_names_dmuons_memory_kinds_without_importing_dmuon():
    import subprocess
    import sys

    import dmuon
    from service.job.plan_document import MEMORY_KINDS

    assert MEMORY_KINDS == dmuon.MEMORY_KINDS
    code = "import sys, service.control.dashboard; print('dmuon' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_plan_on_hypothetical_gpu_nodes_needs_no_service(tmp_path, capsys, monkeypatch):
    """``dmuon-svc plan --nodes``: a GPU plan from this CPU machine; nothing listens at
    DMUON_URL, never asked."""
    from service.control.cli.commands import main as cli_main

    monkeypatch.setenv("DMUON_URL", "http://127.0.0.1:9")
    path = tmp_path / "job.json"
    path.write_text('{"model": "llama3-8b", "seq_len": 4096}')
    assert cli_main(["plan", str(path), "--nodes", "8", "--gpus-per-node", "8",
                     "--gpu-memory-gb", "141"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "layout 8 x 8 (replicate x shard) on 8 nodes: 64 GPU workers"
    assert lines[1] == "planned on 8 assumed nodes of 8 GPUs (given on the command line)"
    assert "of 141.00 GB" in lines[3]


def test_planner_cli_counts_dmuons_process_groups_per_rank():
    """2 on a shard group, 4 with a replicate group, 7 with HSDP and EP: the formula the
    core test (``test_every_group_dmuon_makes_is_warmed_at_set_up_in_one_order``)
    checks against the groups each rank made; 544 MiB each: 4 x 544 x 2^20 B = 2.3 GB,
    7 x = 4.0 GB."""
    proc = _plan_cli("--model", "llama3-8b", "--nodes", "2")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DMuon process groups"))
    assert line.startswith("DMuon process groups per rank: 4 (about 2.3 GB"), line
    proc = _plan_cli("--model", "small-moe", "--nodes", "2", "--ep", "8")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DMuon process groups"))
    assert line.startswith("DMuon process groups per rank: 7 (about 4.0 GB"), line
