"""Meta-device init at half a billion parameters: a model built on ``torch.device("meta")``,
dedicated, fully sharded and ``dmuon.materialize``d on 4 gloo ranks stays within the share
the service's planner predicts for each rank (``service.job.plan.predict``); the values of
meta init are checked against a full init in tests/core/test_meta_init.py."""

from __future__ import annotations

import pytest
from helpers.memory import peak_live_bytes
from helpers.train import materialized_from_meta

import dmuon
from dmuon import cost
from dmuon.testing import run
from service.job.models.builtin import ModelConfig, build_model, init_builtin
from service.job.models.params import split_params
from service.job.plan.inventory import synthetic_inventory
from service.job.plan.predict import predict
from service.job.spec import parse_spec

SEED = 7
# 0.51 B parameters: 18 layers of 4 x 1536^2 attention and 3 x 1536 x 4096 MLP matrices
BIG = dict(vocab_size=256, dim=1536, n_layers=18, n_heads=12, n_kv_heads=12, ffn_dim=4096,
           max_seq_len=64)


def _setup(layout, config):
    # the service's rule: the one the planner's prediction used
    model = build_model(config, device="meta")
    return materialized_from_meta(model, layout, split_params(model).predicate, seed=SEED,
                                  init_fn=init_builtin)


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    with open("/proc/self/status") as fh:
        fields = dict(line.split(":", 1) for line in fh)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def _measure(rank, world, layout):
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current RSS
    rss_before = _rss()[0]
    model, peak_live = peak_live_bytes(lambda: _setup(layout, ModelConfig(**BIG)))
    peak_rss = _rss()[1]
    memory = dmuon.memory_report(model)
    return {"peak_live": peak_live, "rss_growth": peak_rss - rss_before,
            "memory": memory}


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
def test_half_billion_model_sets_up_within_its_planned_share(layout):
    R, N = layout
    spec = parse_spec({"model": BIG, "precision": "float32",
                       "layout": {"replicate": R, "shard": N}})
    plan = predict(spec, synthetic_inventory(R, N, cpus_per_node=N))
    total = sum(p.numel() for p in build_model(ModelConfig(**BIG), device="meta").parameters())
    layer = max(cost.boundary_elements(plan.plan)) * 4  # one boundary in fp32
    assert total >= 500_000_000
    for rank, res in enumerate(run(_measure, layout, world_size=4)):
        m = plan.ranks[rank].memory
        share = m["owned_params"] + m["fsdp_shards"] + m["packed_buffers"]
        bound = 1.1 * (share + layer)
        print(f"{layout} rank {rank}: peak live {res['peak_live'] / 2**20:.0f} MiB, RSS growth "
              f"{res['rss_growth'] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB; a full "
              f"model per rank would be {total * 4 / 2**20:.0f} MiB")
        assert res["memory"]["owned_params"] == m["owned_params"]
        assert res["peak_live"] <= bound
        assert res["rss_growth"] <= bound
