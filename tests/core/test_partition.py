"""Global LPT partition on meta-device Llama-3 shapes, and the errors that name causes."""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import pytest
import torch
from helpers.model import build_model, get_config, muon_predicate
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import dmuon

# max/mean of (elements, NS FLOPs): the partition balances both; 8B at 64 ranks has 96
# equal MLP matrices, so two share a rank (see the pigeonhole test)
LIMITS = {("llama3-8b", 8): (1.01, 1.03), ("llama3-70b", 8): (1.05, 1.03),
          ("llama3-70b", 64): (1.05, 1.03), ("llama3-8b", 64): (1.08, 1.03)}


@pytest.fixture(scope="module", params=["llama3-8b", "llama3-70b"])
def meta_model(request):
    return request.param, build_model(get_config(request.param), device="meta")


def _expected_matrices(cfg):
    hd = cfg.dim // cfg.n_heads
    attn = [(cfg.n_heads * hd, cfg.dim), (cfg.n_kv_heads * hd, cfg.dim),
            (cfg.n_kv_heads * hd, cfg.dim), (cfg.dim, cfg.n_heads * hd)]
    mlp = [(cfg.ffn_dim, cfg.dim)] * 2 + [(cfg.dim, cfg.ffn_dim)]
    return cfg.n_layers * (attn + mlp)


@pytest.mark.parametrize("n", [8, 64])
def test_balance_and_layer_concurrency(meta_model, n):
    name, model = meta_model
    plan = dmuon.partition(model, predicate=muon_predicate, shard_size=n)
    cfg = get_config(name)
    shapes = _expected_matrices(cfg)
    total = sum(r * c for r, c in shapes)
    per_rank = defaultdict(int)
    by_layer = defaultdict(list)
    for fqn, a in plan.params.items():
        per_rank[a.owner] += a.numel
        by_layer[re.search(r"layers\.\d+", fqn).group()].append(a.owner)
    assert len(plan.params) == len(shapes) and sum(per_rank.values()) == total
    ratio = max(per_rank.values()) / (total / n)
    flops = plan.ns_flops_per_rank
    flop_ratio = max(flops) / (sum(flops) / n)
    max_elements, max_flops = LIMITS[(name, n)]
    assert ratio <= max_elements and flop_ratio <= max_flops, (ratio, flop_ratio)
    assert plan.imbalance == pytest.approx(ratio)
    # the NS work summed over ranks is one NS of every matrix
    assert sum(flops) == sum(dmuon.ns_flops(s) for s in shapes)
    for layer, owners in by_layer.items():  # N >= 7: 7 matrices on 7 distinct owners
        assert len(set(owners)) == len(owners) == 7, layer


def test_70b_on_8x8_hsdp_balances_ns_work_and_elements():
    model = build_model(get_config("llama3-70b"), device="meta")
    plan = dmuon.partition(model, predicate=muon_predicate, shard_size=8, replicate_size=8)
    assert plan.ns_imbalance <= 1.03 and plan.imbalance <= 1.05
    assert sorted({a.owner for a in plan.params.values()}) == list(range(64))


def test_8b_at_64_is_at_the_pigeonhole_bound():
    cfg = get_config("llama3-8b")
    model = build_model(cfg, device="meta")
    plan = dmuon.partition(model, predicate=muon_predicate, shard_size=64)
    mlp = cfg.ffn_dim * cfg.dim
    total = sum(r * c for r, c in _expected_matrices(cfg))
    # 96 equal MLP matrices on 64 ranks force two on some rank: nothing beats 2*mlp.
    assert max(plan.elements_per_rank) == 2 * mlp
    assert 2 * mlp / (total / 64) == pytest.approx(1.077, abs=1e-3)


def test_plan_reports_per_rank_figures():
    model = build_model(get_config("tiny"), device="meta")
    plan = dmuon.partition(model, predicate=muon_predicate, shard_size=2, replicate_size=2)
    d = plan.to_dict()
    assert sum(d["elements_per_rank"]) == sum(p.numel() for n, p in model.named_parameters()
                                              if muon_predicate(n, p))
    for a in d["params"].values():
        r, s = a["owner_coord"]
        assert a["owner"] == r * 2 + s
        with FlopCounterMode(display=False) as counter:  # one NS, default backend
            dmuon.newton_schulz(torch.randn(*a["shape"]), dtype=torch.float32)
        assert a["ns_flops"] == counter.get_total_flops()
    assert "imbalance" in plan.table()


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 4)


def test_non_matrix_selected_goes_to_adamw_with_one_warning_naming_each():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dmuon.partition(_Toy(), predicate=lambda n, p: n.startswith("layers"),
                               shard_size=2)
    assert sorted(plan.params) == ["layers.0.weight", "layers.1.weight"]
    assert [w.category for w in caught] == [UserWarning]
    assert re.search(r"2 non-matrix params, which go to AdamW .*: 'layers\.0\.bias' \(4,\), "
                     r"'layers\.1\.bias' \(4,\)$", str(caught[0].message))
    assert caught[0].filename == __file__  # it points at the caller's line
    with pytest.raises(ValueError, match="selected no parameters"), pytest.warns(UserWarning):
        dmuon.partition(_Toy(), predicate=lambda n, p: n.endswith("bias"), shard_size=2)


def test_param_without_boundary_strict_names_it():
    with pytest.raises(ValueError, match=r"'head\.weight' has no hook boundary"):
        dmuon.partition(_Toy(), predicate=lambda n, p: p.ndim == 2, shard_size=2)
    plan = dmuon.partition(_Toy(), predicate=lambda n, p: p.ndim == 2, shard_size=2,
                           hook_boundary_strict=False)
    assert plan.params["head.weight"].boundary == "head"
    assert plan.params["layers.1.weight"].boundary == "layers.1"


def test_boundary_predicate_picks_lowest_matching_ancestor():
    outer = nn.Module()
    outer.block = nn.Module()
    outer.block.inner = nn.Linear(3, 3)
    outer.block.inner.is_hook = True
    plan = dmuon.partition(outer, predicate=lambda n, p: p.ndim == 2, shard_size=1,
                           hook_boundary_predicate=lambda m: isinstance(m, nn.Linear)
                           or hasattr(m, "inner"))
    assert plan.params["block.inner.weight"].boundary == "block.inner"


def test_boundary_with_more_params_than_slots_still_balances():
    toy = nn.Module()
    toy.layers = nn.ModuleList([nn.Module()])
    for i in range(5):
        toy.layers[0].register_parameter(f"w{i}", nn.Parameter(torch.zeros(2, 2)))
    plan = dmuon.partition(toy, predicate=lambda n, p: True, shard_size=2)
    assert sorted(plan.elements_per_rank) == [8, 12]
