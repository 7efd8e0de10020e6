"""The reference's guide "Training" (/work/shared/reference/docs/guides/training.md):
each usage's calls on 4 gloo ranks in float64, checked against a float64 single-process
torch.optim.Muon + AdamW run (dmuon.Muon's defaults here, docs/migration.md), an exact
invariant or a formula written here. One distributed run holds every set-up (a process
start costs more than these steps). The quickstart, "Gradient Accumulation" and "Z2 vs Z3
Modes": test_guides_quickstart.py; "Checkpointing": test_guides_checkpoint.py.

Usages tested elsewhere with the same calls (guide section: test):

- "Check NS Backend" (`get_ns_backend()`, `get_backend_status()`):
  test_ns_backends.py::test_kernel_reports
- "Hyperparameter Guide" (`ns_backend="direct"`), "Semantic Param Groups" (`muon_lr`,
  `adamw_lr`, `muon_weight_decay` overrides):
  test_reference_api.py::test_direct_backend_and_named_param_groups_match_torch_muon
- "Hyperparameter Guide" (`ns_backend=dmuon.NewtonSchulz(...)`):
  test_ns_backends.py::test_muon_takes_a_newton_schulz_object
- "Semantic Param Groups" (`dmuon_route`): test_routing.py::test_param_groups_split_by_route,
  test_reference_api.py::test_reference_forms_without_a_meaning_here_say_what_to_use
- "Semantic Param Groups" ("Schedulers and checkpoints work"):
  test_param_groups.py::test_checkpoint_with_groups_resumes_bit_identically
- "Gradient Clipping" (`register_muon_grad_clip_strategy`), "Fused CUDA clip"
  (`try_clip_optimizer_grad_norm_buckets_`):
  test_clip_buckets.py::test_wall_x_buckets_and_muon_strategies_match_one_process
- "Process Group Policy" (`process_group_policy="isolated"`, the default):
  test_post_step.py::test_trainer_collectives_and_explicit_calls_change_nothing
- Step 1's tip "HuggingFace models" (a Hugging Face model with the guide's predicate):
  test_reference_setups.py::test_proj_predicate_sends_qwen2_biases_to_adamw_and_matches_the_reference
- "Scaling Out" (the HSDP set-up): test_guides_quickstart.py::test_quickstart_matches_one_process
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from helpers.guides import (
    assert_matches,
    global_loss,
    names_of,
    one_process,
    proj_predicate,
    rel,
    tiny,
    torch_optimizers,
    two_step_reference,
)
from helpers.model import build_model, get_config
from helpers.train import global_batches, local_rows, loss_of
from torch.distributed.device_mesh import init_device_mesh

import dmuon
from dmuon.testing import run

WORLD, STEPS = 4, 3
# the tiny model's gradient norms are below 1: a loss x8 makes both of the guide's clips
# (torch's on AdamW params, dmuon's) act at its max_norm=1.0
LOSS_SCALE = 8.0
STEP4 = dict(lr=0.02, momentum=0.95, ns_steps=5, nesterov=True, weight_decay=0.0,
             adamw_lr=1e-3, adamw_betas=(0.9, 0.999), adamw_weight_decay=0.01, adamw_eps=1e-8)
# training.md "Writing the Predicate"; a wide MLP (64 x 2048 > 100k elements) so that
# the GateDelta pattern keeps the MLP matrices and drops the 64 x 64 attention ones
WIDE = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=2048,
            max_seq_len=64)


def _selective(n, p):
    if p.ndim != 2:
        return False
    if "embed" in n or "head" in n or "lm_head" in n:
        return False
    return "proj" in n


def _gatedelta(n, p):
    if p.ndim != 2:
        return False
    if p.numel() < 100_000:  # too small for NS to be worthwhile
        return False
    return "proj" in n


PREDICATES = {"standard": proj_predicate, "selective": _selective, "gatedelta": _gatedelta}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _step4(rank, world, clip=None) -> dict:
    """training.md Steps 1-5 on the Llama-style test model; ``clip``: "Gradient Clipping"
    (None, "guide": the guide's two calls, "strategy": with strategy="global_norm")."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    handler = _Records()
    logging.getLogger().addHandler(handler)  # "Verify Parameter Assignment"
    logging.getLogger().setLevel(logging.INFO)
    assignment = dmuon.dedicate_params(model, mesh,
                                       predicate=lambda n, p: "proj" in n and p.ndim == 2)
    logging.getLogger().removeHandler(handler)
    names = names_of(model)
    out = {"assignment": {names[id(p)]: owner for p, owner in assignment.items()},
           "log": handler.lines}
    owned = dmuon.get_owned_params(model, rank=dist.get_rank())  # "Inspecting the Assignment"
    out["total_owned"] = sum(p.numel() for p in owned)
    all_dp = dmuon.get_dedicated_params(model)  # "Check Dedicated vs Symmetric Counts"
    owned_dp = dmuon.get_owned_params(model, rank=dist.get_rank())
    out["counts"] = (len(all_dp), len(owned_dp), len(list(model.parameters())) - len(all_dp))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, **STEP4)
    out["groups"] = [(g["use_muon"], len(g["params"])) for g in optimizer.param_groups]
    adamw_params = [p for n, p in model.named_parameters() if not proj_predicate(n, p)]
    out["norms"] = []
    for batch in global_batches(STEPS):
        optimizer.zero_grad()
        loss = loss_of(model, local_rows(batch, rank, world))  # model(batch).loss
        if clip is not None:
            loss = loss * LOSS_SCALE
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(adamw_params, max_norm=1.0)
            kw = {"strategy": "global_norm"} if clip == "strategy" else {}
            out["norms"].append(dmuon.clip_grad_norm_(optimizer, max_norm=1.0, **kw))
        optimizer.step()
    out["full"] = dmuon.full_state_dict(model)
    if clip == "strategy":  # "Clip stats are on-device tensors": an inf norm is found_inf
        loss_of(model, local_rows(global_batches(1)[0], rank, world)).backward()
        dmuon.wait_all_reduces(model)
        for g in [t.grad for t in dmuon.get_state(model).owned_params.values()][:1]:
            g.view(-1)[0] = float("inf")
        out["inf"] = dmuon.clip_grad_norm_(optimizer, max_norm=1.0, strategy="global_norm")
        optimizer.zero_grad()
    return out


def _semantic_groups(rank, world) -> dict:
    """training.md "Semantic Param Groups", decoder layer 1 standing in for the guide's
    "action_transformer" (the test model has none); then the three refusals."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    stale = list(model.parameters())
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    base_params = []
    action_params = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if "layers.1." in name:
            action_params.append(param)
        else:
            base_params.append(param)
    optimizer = dmuon.Muon(model, lr=5e-5, adamw_lr=5e-5, param_groups=[
        {"params": base_params, "lr": 5e-5, "group_name": "base"},
        {"params": action_params, "lr": 1e-4, "group_name": "action"},
    ])
    out = {"names": [g["group_name"] for g in optimizer.param_groups], "refused": {}}
    for batch in global_batches(STEPS):
        optimizer.zero_grad()
        loss_of(model, local_rows(batch, rank, world)).backward()
        optimizer.step()
    out["full"] = dmuon.full_state_dict(model)
    for key, groups in {"missing": [{"params": base_params}],
                        "duplicate": [{"params": base_params + action_params[:1]},
                                      {"params": action_params}],
                        "stale": [{"params": stale}]}.items():
        try:
            dmuon.Muon(model, param_groups=groups)
            out["refused"][key] = None
        except (ValueError, TypeError) as e:
            out["refused"][key] = str(e)
    return out


def _predicates(rank, world) -> dict:
    """training.md "Writing the Predicate": each common pattern, two steps."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for key, predicate in PREDICATES.items():
        mesh = init_device_mesh("cpu", (world,))
        model = build_model(_wide(), dtype=torch.float64, seed=0)
        dmuon.dedicate_params(model, mesh, predicate=predicate)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
        for batch in global_batches(2):
            optimizer.zero_grad()
            loss_of(model, local_rows(batch, rank, world)).backward()
            optimizer.step()
        names = names_of(model)
        out[key] = {"dedicated": sorted(names[id(p)] for p in dmuon.get_dedicated_params(model)),
                    "full": dmuon.full_state_dict(model)}
    return out


def _wide():
    from helpers.model import ModelConfig

    return ModelConfig(**WIDE)


TYPE_SPLIT = {
    "defaults": {"route": "adamw", "param_dtype": torch.bfloat16},
    "overrides": [
        {"name": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
         "set": {"route": "muon"}},
        {"name": ["embed_tokens", "lm_head"], "set": {"route": "sharded_adamw"}},
    ],
}


def _type_split(rank, world) -> dict:
    """training.md "Advanced: Type-Split Routing": the guide's call, refused here for the
    final norm (no layers.N ancestor); then with hook_boundary_strict=False, the
    reference's fallback (docs/migration.md "strict_heuristic"), one step."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for strict in (True, False):
        model = build_model(get_config("tiny"), dtype=torch.float32, seed=0)
        try:
            dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.requires_grad,
                                  param_policy=TYPE_SPLIT,
                                  **({} if strict else {"hook_boundary_strict": False}))
        except ValueError as e:
            out["strict"] = str(e)
            continue
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3)
    loss = loss_of(model, local_rows(global_batches(1)[0], rank, world))
    loss.backward()
    optimizer.step()
    out["loss"] = loss.item()
    rows = dmuon.summarize_param_groups(model, optimizer)["params"]
    out["routes"] = {r["name"]: (r["route"], r["param_dtype"]) for r in rows}
    return out


def _shard_first(world) -> str:
    """training.md "Order: dedicate first, then shard": the other order."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2)
    except (ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _guides(rank, world) -> dict:
    return {"shard_first": _shard_first(world),
            "step4": {clip: _step4(rank, world, clip) for clip in (None, "guide", "strategy")},
            "semantic": _semantic_groups(rank, world),
            "predicates": _predicates(rank, world),
            "type_split": _type_split(rank, world)}


@functools.cache
def _runs():
    return run(_guides, world_size=WORLD)


# -- float64 single-process references ------------------------------------------------

def _clip_reference(clip):
    """One process: torch's clip on the AdamW params, then the global one (dmuon's
    meaning here) or the Muon params' own (strategy="global_norm", the reference's)."""
    model, norms = tiny(), []

    def before_step(m):
        named = list(m.named_parameters())
        torch.nn.utils.clip_grad_norm_([p for n, p in named if not proj_predicate(n, p)], 1.0)
        second = [p for n, p in named if clip == "guide" or proj_predicate(n, p)]
        norms.append(torch.nn.utils.clip_grad_norm_(second, 1.0).item())

    scale = 1.0 if clip is None else LOSS_SCALE
    final, _ = one_process(model, torch_optimizers(model, **STEP4),
                           global_loss(global_batches(STEPS), scale), STEPS,
                           before_step if clip is not None else None)
    return final, norms


# -- guides/training.md ------------------------------------------------------------------

def test_training_steps_1_to_5_match_one_process():
    """training.md "Step 4: Create Optimizer" (every keyword it shows) and "Step 5:
    Training Loop": 3 steps against torch.optim.Muon + AdamW with those keywords; Group
    0 is Muon on the owned matrices, group 1 AdamW on the rest."""
    ref, _ = _clip_reference(None)
    results = _runs()
    for res in results:
        assert_matches(res["step4"][None]["full"], ref)
        owned = res["step4"][None]["counts"][1]
        assert res["step4"][None]["groups"] == [(True, owned), (False, 7)]


def test_training_shard_before_dedicate_is_refused():
    """training.md "Step 3: Apply FSDP2", its warning "Order: dedicate first, then
    shard": `dedicate_params` after `fully_shard` is refused, naming the order."""
    for res in _runs():
        assert res["shard_first"].startswith("RuntimeError: fully_shard was applied to")
        assert "call dedicate_params first" in res["shard_first"]


def test_training_assignment_and_counts():
    """training.md "Step 2: Dedicate Parameters" (`assignment = dedicate_params(...)`)
    and "Check Dedicated vs Symmetric Counts": the assignment maps exactly the predicate's
    params to ranks, each rank owns those mapped to it, the rest are FSDP2's."""
    named = list(tiny().named_parameters())
    proj = {n for n, p in named if proj_predicate(n, p)}
    results = [res["step4"][None] for res in _runs()]
    for rank, res in enumerate(results):
        assert set(res["assignment"]) == proj
        assert set(res["assignment"].values()) <= set(range(WORLD))
        mine = sum(owner == rank for owner in res["assignment"].values())
        assert res["counts"] == (len(proj), mine, len(named) - len(proj))
    assert sum(res["counts"][1] for res in results) == len(proj)


def test_training_inspecting_the_assignment():
    """training.md "Inspecting the Assignment": `sum(dp.numel for dp in owned)`, the
    elements this rank owns. `get_owned_params` returns the module's params here
    (docs/migration.md: "different"), whose `numel` is torch's method: the guide's sum
    is `sum(p.numel() for p in owned)`."""
    model = tiny()
    for rank, res in enumerate(_runs()):
        assignment = res["step4"][None]["assignment"]
        expected = sum(p.numel() for n, p in model.named_parameters()
                       if assignment.get(n) == rank)
        assert res["step4"][None]["total_owned"] == expected


def test_training_verify_parameter_assignment_log():
    """training.md "Verify Parameter Assignment": at INFO, `dedicate_params: 14 params
    assigned to 4 ranks, imbalance=..., loads=[...]`."""
    for res in _runs():
        assert any(line.startswith("dedicate_params: 14 params assigned to 4 ranks")
                   for line in res["step4"][None]["log"])


@pytest.mark.parametrize("clip", ["guide", "strategy"])
def test_training_gradient_clipping(clip):
    """training.md "Gradient Clipping": torch's `clip_grad_norm_(adamw_params, 1.0)`, then
    `dmuon.clip_grad_norm_(optimizer, max_norm=1.0)`: here the global norm of every
    gradient (docs/migration.md: "different"); with strategy="global_norm" the
    reference's Muon-only clip. Both against one process clipping the same sets."""
    ref, norms = _clip_reference(clip)
    assert min(norms) > 1.0  # the second clip acts at every step
    for res in _runs():
        assert_matches(res["step4"][clip]["full"], ref)
        got = res["step4"][clip]["norms"]
        got = [s.total_norm if clip == "strategy" else s for s in got]
        assert [t.item() for t in got] == pytest.approx(norms, rel=1e-12)


def test_training_clip_stats_are_0_dim_tensors_and_inf_is_not_a_clip():
    """training.md "Clip stats are on-device tensors": `MuonGradClipStats` fields are
    0-dim tensors; an inf norm is `found_inf=True`, `clipped=False`."""
    for res in _runs():
        stats = res["step4"]["strategy"]["norms"]
        for s in stats:
            for f in (s.total_norm, s.clip_coef, s.clipped, s.found_inf):
                assert isinstance(f, torch.Tensor) and f.dim() == 0
            assert bool(s.clipped) and not bool(s.found_inf)
            assert s.clip_coef.item() == pytest.approx(1.0 / (s.total_norm.item() + 1e-6))
        inf = res["step4"]["strategy"]["inf"]
        assert bool(inf.found_inf) and not bool(inf.clipped)


def test_training_semantic_param_groups():
    """training.md "Semantic Param Groups": base at lr 5e-5, action (decoder layer 1
    here) at 1e-4, each lowered into /muon and /adamw; the updates against torch's
    optimizers with the same four groups; missing, duplicate and stale (pre-wrapping)
    params refused at construction."""
    model, init = tiny(), {k: v.clone() for k, v in tiny().state_dict().items()}
    named = list(model.named_parameters())
    part = lambda muon, action: [p for n, p in named  # noqa: E731
                                 if proj_predicate(n, p) == muon and ("layers.1." in n) == action]
    opts = torch_optimizers(([{"params": part(True, False), "lr": 5e-5},
                              {"params": part(True, True), "lr": 1e-4}],
                             [{"params": part(False, False), "lr": 5e-5},
                              {"params": part(False, True), "lr": 1e-4}]), lr=5e-5, adamw_lr=5e-5)
    ref, _ = one_process(model, opts, global_loss(global_batches(STEPS)), STEPS)
    for res in _runs():
        sem = res["semantic"]
        assert sorted(sem["names"]) == sorted(["base/muon", "base/adamw", "action/muon",
                                               "action/adamw"])
        for key, value in ref.items():  # the updates: lr 5e-5 barely moves the weights
            assert rel(sem["full"][key] - init[key], value - init[key]) <= 1e-9, key
        assert "leave out" in sem["refused"]["missing"]
        assert "in param_groups 0 and 1" in sem["refused"]["duplicate"]
        assert sem["refused"]["stale"] is not None


def test_training_writing_the_predicate():
    """training.md "Writing the Predicate", its three patterns (standard, selective,
    GateDelta's numel threshold): exactly the params each selects are dedicated, and
    two steps match one process with Muon on that set."""
    model = build_model(_wide(), device="meta")
    for key, predicate in PREDICATES.items():
        selected = sorted(n for n, p in model.named_parameters() if predicate(n, p))
        ref = two_step_reference(predicate, _wide())
        for res in _runs():
            assert res["predicates"][key]["dedicated"] == selected, key
            assert_matches(res["predicates"][key]["full"], ref)
    assert _runs()[0]["predicates"]["gatedelta"]["dedicated"] != \
        _runs()[0]["predicates"]["standard"]["dedicated"]


def test_training_type_split_routing():
    """training.md "Advanced: Type-Split Routing", its param_policy: refused here for
    the final norm outside `layers.N` (docs/migration.md "strict_heuristic"); with
    hook_boundary_strict=False each param takes the rule's route and dtype, and the
    first loss (bf16 compute) is the float64 one to bf16's precision."""
    tokens = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    results = [res["type_split"] for res in _runs()]
    assert "model.norm.weight" in results[0]["strict"]
    expected = {}  # every param in the default's bf16 (FSDP2's policy for sharded_adamw)
    for n, _ in tiny().named_parameters():
        if "embed_tokens" in n or "lm_head" in n:
            expected[n] = ("sharded_adamw", "torch.bfloat16")
        else:
            expected[n] = ("muon" if any(t in n for t in tokens) else "adamw", "torch.bfloat16")
    ref = loss_of(tiny(), global_batches(1)[0]).item()
    for res in results:
        assert res["routes"] == expected
    assert sum(res["loss"] for res in results) / WORLD == pytest.approx(ref, rel=2e-2)


