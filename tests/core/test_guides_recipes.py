"""The reference's guides ``guides/custom-hook-boundaries.md``,
``guides/integration-recipes.md`` and ``guides/pure-dmuon-routing.md``, their code done
with the same dmuon calls and keywords on 4 gloo ranks in float64 (``ns_dtype`` added so
that the comparison can be to 1e-9), each against a float64 single-process reference
(torch.optim.Muon + AdamW at dmuon.Muon's defaults) or an exact invariant. The guides'
models are written here small, with a forward each (the guides give none). Usages tested
elsewhere, with the same calls:

- pure-dmuon-routing.md "Control Surface" (``predicate=lambda name, param:
  param.requires_grad``, the three routes, 10 steps on 1 x 4 and 2 x 2):
  test_routing.py::test_pure_dmuon_matches_float64_reference
- pure-dmuon-routing.md, ``route_hint_fn``: test_routing.py::test_route_hint_fn_is_the_same_routing
- pure-dmuon-routing.md "Control Surface", ``contains`` as ``name``, ordered overrides,
  a missing route is ``"muon"``: test_routing.py::test_override_rules
- pure-dmuon-routing.md "Routing Policy", an fp32 head with ``output_dtype`` and
  ``cast_forward_inputs`` in a bf16 body:
  test_param_precision.py::test_fp32_head_in_bf16_body_equals_fsdp2_per_module_policies
- integration-recipes.md, ``no_sync`` accumulation on other layouts:
  test_accumulation.py::test_repeated_backward_and_no_sync_equal_one_backward_of_the_sum
- integration-recipes.md manual_overrides.py, ``wait_all_replicate_broadcasts`` then
  ``get_model_state_dict``: test_guides_parallel.py::test_drained_model_state_dict_is_the_reference

``fully_shard`` is the guides' import, after helpers.model's ``import dmuon``: the name
is then dmuon's (docs/migration.md). Usages that cannot run here (``from_pretrained`` of
a hub checkpoint, NCCL and CUDA set-up lines, the HF Trainer, torchtitan's own
``parallelize_model``, DeepSpeed) are listed in docs/migration.md. The other two guides'
tests are in test_guides_integration.py, with this guide's Example 3 (a Hugging Face
model).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.train import reference_ns
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.testing import run

STEPS, WORLD, D, ROWS = 3, 4, 16, 16
GUIDE_MUON = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0)
GUIDE_ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


def reference_train(model, is_muon, batches, loss):
    """One process, the whole batch: torch.optim.Muon where ``is_muon``, AdamW on the
    rest, Newton-Schulz in float64."""
    named = dict(model.named_parameters())
    muon = [p for n, p in named.items() if is_muon(n, p)]
    rest = [p for n, p in named.items() if not is_muon(n, p)]
    opts = [torch.optim.Muon(muon, **GUIDE_MUON)]
    opts += [torch.optim.AdamW(rest, **GUIDE_ADAMW)] if rest else []
    with reference_ns():
        for batch in batches:
            loss(model, batch).backward()
            for o in opts:
                o.step()
                o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(model, opt, batches, loss):
    for batch in batches:
        opt.zero_grad()
        loss(model, batch).backward()
        opt.step()
    return dmuon.full_state_dict(model)


def assert_close(full, ref, bound=1e-9):
    assert set(full) == set(ref)
    for key, value in ref.items():
        scale = value.abs().max() if value.any() else 1.0  # an all-zero bias: no 0 / 0
        err = ((full[key] - value).abs().max() / scale).item()
        assert err <= bound, (key, err)


def boundary_names(model):
    return [b.name for b in dmuon.get_state(model).boundaries]


def regression_batches(d_out, steps=STEPS):
    """(inputs, targets) of the whole batch per step, float64."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(ROWS, D, generator=g, dtype=torch.float64),
             torch.randn(ROWS, d_out, generator=g, dtype=torch.float64)) for _ in range(steps)]


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def rows_of(batches, rank, world):
    per = ROWS // world
    return [tuple(t[rank * per:(rank + 1) * per] for t in b) for b in batches]


# -- guides/custom-hook-boundaries.md: the guide's classes, small, with forwards ---------

class VitBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class VisionTower(nn.Module):
    def __init__(self, d=1024, n=24):
        super().__init__()
        self.blocks = nn.ModuleList([VitBlock(d) for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class DecoderLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_proj = nn.Linear(d, 4 * d, bias=False)
        self.down_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = x + self.o_proj(torch.sigmoid(self.q_proj(x)) * self.v_proj(x))
        return x + self.down_proj(F.gelu(self.gate_proj(x)))


class ActionHead(nn.Module):
    def __init__(self, d, n_actions=7):
        super().__init__()
        self.fc1 = nn.Linear(d, d, bias=False)
        self.fc2 = nn.Linear(d, n_actions, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ToyVLA(nn.Module):
    def __init__(self, d=1024, n_vit=24, n_dec=28):
        super().__init__()
        self.visual = VisionTower(d, n_vit)
        self.layers = nn.ModuleList([DecoderLayer(d) for _ in range(n_dec)])
        self.action_head = ActionHead(d)

    def forward(self, x):
        x = self.visual(x)
        for layer in self.layers:
            x = layer(x)
        return self.action_head(x)


class Expert(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x)))


class MoELayer(nn.Module):
    def __init__(self, d, d_ff, n_experts=8):
        super().__init__()
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList([Expert(d, d_ff) for _ in range(n_experts)])
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        # dense soft routing: every expert gets every row, so every expert has a gradient
        weights = self.router(x).softmax(-1)
        mixed = sum(weights[:, e:e + 1] * expert(x) for e, expert in enumerate(self.experts))
        return x + self.o_proj(mixed)


class MoEModel(nn.Module):
    def __init__(self, d, d_ff, n_experts, n_layers):
        super().__init__()
        self.layers = nn.ModuleList([MoELayer(d, d_ff, n_experts) for _ in range(n_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class TransformerLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def built(factory):
    """``factory()`` in float64 with the same values on every rank and in the reference."""
    torch.manual_seed(0)
    return factory().to(torch.float64)


def toy_vla():
    return built(lambda: ToyVLA(D, n_vit=3, n_dec=2))


def moe_model():
    return built(lambda: MoEModel(D, 2 * D, n_experts=3, n_layers=2))


def sequential():
    return built(lambda: nn.Sequential(nn.Linear(D, 4 * D, bias=False), nn.GELU(),
                                       nn.Linear(4 * D, D, bias=False)))


def stack():
    """Layers under no ``layers.N`` name: the predicate alone places the hooks."""
    return built(lambda: nn.Sequential(TransformerLayer(D), TransformerLayer(D)))


def _attempt(call):
    """``call()``'s result, or the exception it raised as ``(type name, message)``."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the test reports what the guide's call did
        return (type(e).__name__, str(e))


def _optimizer(model):
    return dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float64)


def _vla(mesh):
    """Example 1: VLA model (vision tower + decoder layers + action head)."""
    model = toy_vla()

    def boundary(m):
        return isinstance(m, (VisionTower, DecoderLayer, ActionHead))

    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2,
                          hook_boundary_predicate=boundary, hook_boundary_strict=True)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.visual, mesh=mesh)
    fully_shard(model.action_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _optimizer(model)


def _moe(mesh):
    """Example 2: MoE model, the router left out by the predicate."""
    model = moe_model()
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "router" not in n,
                          hook_boundary_predicate=lambda m: isinstance(m, (Expert, MoELayer)),
                          hook_boundary_strict=True)
    for layer in model.layers:
        for expert in layer.experts:
            fully_shard(expert, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _optimizer(model)


def _sequential(mesh):
    """Example 4: nn.Sequential without ``hook_boundary_predicate``; here the strict
    default refuses it, ``hook_boundary_strict=False`` is the reference's behaviour
    (docs/migration.md, "strict_heuristic")."""
    model = sequential()
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2,
                          hook_boundary_strict=False)
    fully_shard(model, mesh=mesh)
    return model, _optimizer(model)


def _aligned(mesh):
    """"Aligning with fully_shard boundaries": one predicate for both."""
    model = stack()

    def is_transformer_layer(m):
        return isinstance(m, TransformerLayer)

    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2,
                          hook_boundary_predicate=is_transformer_layer, hook_boundary_strict=True)
    for module in model.modules():
        if is_transformer_layer(module):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _optimizer(model)


HOOK_SETUPS = {"vla": (_vla, 7), "moe": (_moe, D), "sequential": (_sequential, D),
               "aligned": (_aligned, D)}


def _pitfalls(mesh):
    """"Pitfalls" and "strict=True vs strict=False" on the tests' Llama: a predicate
    that covers attention only (too narrow), strict and lenient; one that accepts every
    module (too broad); the Sequential example as the guide writes it."""
    from helpers.model import Attention, build_model, get_config

    def dedicate(model, **kwargs):
        dmuon.dedicate_params(model, mesh, predicate=lambda n, p: "proj" in n and p.ndim == 2,
                              **kwargs)
        return boundary_names(model)

    tiny = functools.partial(build_model, get_config("tiny"), dtype=torch.float64, seed=0)
    narrow = lambda m: isinstance(m, Attention)  # noqa: E731
    return {
        "narrow_strict": _attempt(lambda: dedicate(tiny(), hook_boundary_predicate=narrow)),
        "narrow_lenient": dedicate(tiny(), hook_boundary_predicate=narrow,
                                   hook_boundary_strict=False),
        "broad": dedicate(tiny(), hook_boundary_predicate=lambda m: isinstance(m, nn.Module)),
        "sequential_default": _attempt(lambda: dmuon.dedicate_params(
            sequential(), mesh, predicate=lambda n, p: p.ndim == 2)),
    }


def _hooks(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    out = {"pitfalls": _pitfalls(mesh)}
    for name, (setup, d_out) in HOOK_SETUPS.items():
        model, opt = setup(mesh)
        out[name] = {"boundaries": boundary_names(model),
                     "final": train(model, opt, rows_of(regression_batches(d_out), rank, world),
                                    mse)}
    return out


@functools.cache
def hook_runs():
    return run(_hooks, world_size=WORLD)


FACTORIES = {"vla": (toy_vla, lambda n, p: p.ndim == 2),
             "moe": (moe_model, lambda n, p: p.ndim == 2 and "router" not in n),
             "sequential": (sequential, lambda n, p: p.ndim == 2),
             "aligned": (stack, lambda n, p: p.ndim == 2)}


@pytest.mark.parametrize("name", list(HOOK_SETUPS))
def test_hook_boundary_examples_match_the_float64_reference(name):
    """guides/custom-hook-boundaries.md, "Worked examples" 1 (VLA), 2 (MoE), 4
    (nn.Sequential) and "Aligning with fully_shard boundaries": trained 3 steps, every
    param as one process's Muon + AdamW gives it."""
    factory, is_muon = FACTORIES[name]
    ref = reference_train(factory(), is_muon, regression_batches(HOOK_SETUPS[name][1]), mse)
    for res in hook_runs():
        assert_close(res[name]["final"], ref)


def test_hook_sites_are_the_ones_each_example_states():
    """guides/custom-hook-boundaries.md: Example 1, "All 24 ViT blocks collapse onto a
    single model.visual hook site; each decoder layer and the action head get their
    own site"; Example 2, "Each expert is a separate hook site; the router stays with the
    outer MoELayer"; Example 4, per-Linear hooks; aligned, one site per layer."""
    experts = [f"layers.{i}.experts.{e}" for i in range(2) for e in range(3)]
    for res in hook_runs():
        assert sorted(res["vla"]["boundaries"]) == ["action_head", "layers.0", "layers.1",
                                                    "visual"]
        assert sorted(res["moe"]["boundaries"]) == sorted(["layers.0", "layers.1", *experts])
        assert res["sequential"]["boundaries"] == ["0", "2"]
        assert res["aligned"]["boundaries"] == ["0", "1"]


def test_pitfalls_strict_narrow_and_broad_predicates():
    """guides/custom-hook-boundaries.md, "strict=True vs strict=False" and "Pitfalls":
    too narrow raises under strict (naming an uncovered param) and falls back per
    ``nn.Linear`` when lenient; too broad (``isinstance(m, nn.Module)``); Example 4 as
    written is refused here by the strict default (docs/migration.md "strict_heuristic")."""
    for res in hook_runs():
        p = res["pitfalls"]
        assert p["narrow_strict"][0] == "ValueError" and "mlp" in p["narrow_strict"][1]
        attn = [f"model.layers.{i}.self_attn" for i in range(2)]
        mlp = [f"model.layers.{i}.mlp.{n}" for i in range(2)
               for n in ("gate_proj", "up_proj", "down_proj")]
        assert sorted(p["narrow_lenient"]) == sorted(attn + mlp)
        # too broad: "The API"'s bottom-up walk stops at each param's own module (the
        # Pitfalls text's "collapsing all parameters into one site" is the root's, which
        # a bottom-up walk never reaches while a lower module matches)
        linears = [f"model.layers.{i}.self_attn.{n}" for i in range(2)
                   for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        assert sorted(p["broad"]) == sorted(linears + mlp)
        assert p["sequential_default"][0] == "ValueError"
        assert "hook_boundary_strict=False" in p["sequential_default"][1]
