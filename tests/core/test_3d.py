"""3-D parallelism: HSDP (replicate x shard) x TP on gloo, in the seeds' composition order
(TP on ``mesh["tp"]``, ``dedicate_params`` on ``mesh["shard"]`` with ``replicate_mesh``,
FSDP2 on ``mesh["replicate", "shard"]``).

The reference implementation's 3-D scenario: 8 ranks as R 2 x N 2 x T 2, MLP blocks of
width 256/1024, colwise gate/up, rowwise down, predicate ``"proj" in n and p.ndim == 2``,
against one process running torch.optim.Muon (float64 NS) + AdamW on the whole batch.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from helpers.train import HPARAMS, fp64_newton_schulz, lr_lambda, reference_ns, reference_optimizers
from torch import nn

import dmuon
from dmuon.testing import run

STEPS, ROWS, DIM, HIDDEN, IN, OUT = 10, 16, 256, 1024, 32, 8
SAVE_AT = 5
MESH_DIMS = ("replicate", "shard", "tp")


def predicate(name, p):
    return "proj" in name and p.ndim == 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def net() -> Net:
    torch.manual_seed(0)
    model = Net().to(torch.float64)
    with torch.no_grad():  # weights large enough that NS sees well-conditioned updates
        for p in model.parameters():
            p.mul_(4.0)
    return model


def batches(steps=STEPS):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(ROWS, IN, generator=g, dtype=torch.float64),
             torch.randn(ROWS, OUT, generator=g, dtype=torch.float64)) for _ in range(steps)]


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel()}


def mesh_3d(layout):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", layout, mesh_dim_names=MESH_DIMS)


def dp_coordinate(mesh) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size): TP peers share their rows."""
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    return r * mesh["shard"].size() + s, mesh["replicate"].size() * mesh["shard"].size()


def build_3d(layout, z3=True, replicate_async=True):
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = mesh_3d(layout)
    model = net()
    if layout[2] > 1:
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], tp_plan())
    plan = dmuon.dedicate_params(model, mesh["shard"], predicate,
                                 replicate_mesh=mesh["replicate"], reshard_after_forward=z3)
    dp_mesh = mesh["replicate", "shard"]
    for block in model.blocks:
        dmuon.fully_shard(block, mesh=dp_mesh, reshard_after_forward=z3)
    dmuon.fully_shard(model, mesh=dp_mesh, reshard_after_forward=z3)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64, replicate_async=replicate_async)
    return mesh, model, opt, plan


def train_3d(rank, world, layout, z3=True, replicate_async=True, save_at=None, path=None,
             load=False):
    mesh, model, opt, plan = build_3d(layout, z3, replicate_async)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    dp, dp_size = dp_coordinate(mesh)
    out, start = {"plan": plan.to_dict(), "table": plan.table()}, 0
    if load:
        extra = dmuon.checkpoint.load(path, model, opt)
        start = extra["step"]
        sched.load_state_dict(extra["sched"])
        out["loaded"] = dmuon.full_state_dict(model)
    per = ROWS // dp_size
    for step, (x, y) in enumerate(batches()):
        if step < start:
            continue
        mse(model, x[dp * per:(dp + 1) * per], y[dp * per:(dp + 1) * per]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        if save_at == step + 1:
            dmuon.checkpoint.save(path, model, opt,
                                  extra={"step": step + 1, "sched": sched.state_dict()})
            out["saved"] = dmuon.full_state_dict(model)
    out["final"] = dmuon.full_state_dict(model)
    out["ledger"] = dmuon.get_ledger(model).last_step_by_phase()
    out["coord"] = tuple(mesh[d].get_local_rank() for d in MESH_DIMS)
    return out


def reference(start_state=None, start=0, steps=STEPS) -> dict:
    """One process, the whole batch: torch.optim.Muon (float64 NS) + AdamW; optionally
    from ``start_state`` (a model and optimizer state saved after ``start`` steps)."""
    model = net()
    muon = [p for n, p in model.named_parameters() if predicate(n, p)]
    others = [p for n, p in model.named_parameters() if not predicate(n, p)]
    opts = reference_optimizers(muon, others)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in opts]
    states = {}
    with reference_ns(fp64_newton_schulz):
        for step, (x, y) in enumerate(batches(steps)):
            mse(model, x, y).backward()
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
            for o in opts:
                o.zero_grad()
            states[step + 1] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return states


@functools.cache
def ref_states():
    return reference()


@functools.cache
def run_3d(layout=(2, 2, 2), z3=True, replicate_async=True, save_at=None, path=None,
           load=False):
    return run(train_3d, layout, z3=z3, replicate_async=replicate_async, save_at=save_at,
               path=path, load=load, world_size=layout[0] * layout[1] * layout[2])


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_matches(states: dict, expected: dict, bound=1e-9):
    for key, value in expected.items():
        err = _rel_err(states[key], value)
        assert err <= bound, (key, err)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The 2 x 2 x 2 run (Z3, async replicate), saving a checkpoint after step 5."""
    path = str(tmp_path_factory.mktemp("ckpt_3d") / "step5")
    return run_3d(save_at=SAVE_AT, path=path), path


def test_3d_matches_single_process_reference_on_every_rank(base):
    ref = ref_states()[STEPS]
    results, _ = base
    assert sorted(r["coord"] for r in results) == sorted(
        (r, s, t) for r in range(2) for s in range(2) for t in range(2))
    for res in results:
        assert_matches(res["final"], ref)


def test_3d_sync_z2_is_bit_identical_to_async_z3(base):
    """Z2 (packed buffers kept) with the replicate all-gather waited for at once equals
    Z3 with it consumed by the next forward, torch.equal: the same arithmetic on the
    same values, only the timing of the collectives differs (one 8-rank run for both)."""
    other = run_3d(z3=False, replicate_async=False)
    for a, b in zip(base[0], other):
        assert a["coord"] == b["coord"]
        for key, value in a["final"].items():
            assert torch.equal(value, b["final"][key]), key


def test_owners_balance_over_every_dp_coordinate_of_each_tp_column(base):
    """Each matrix has one owner coordinate (r, s), shared by the T peers that hold its
    shards; the 6 matrices of equal size fill the 4 coordinates as evenly as LPT can
    (2, 2, 1, 1 with one boundary's three on distinct owners), and the plan table shows
    a row per (r, s, t)."""
    res = base[0][0]
    owners = Counter(tuple(a["owner_coord"]) for a in res["plan"]["params"].values())
    assert sorted(owners.values()) == [1, 1, 2, 2] and len(owners) == 4
    rows = [line.split()[1] for line in res["table"].splitlines()[1:-1]]
    assert rows == [f"({r},{s},{t})" for r in range(2) for s in range(2) for t in range(2)]


@pytest.mark.parametrize("layout", [(1, 2, 2), (1, 4, 1)], ids=["1x2x2", "1x4x1"])
def test_checkpoint_from_2x2x2_loads_on_another_layout_and_trains_on(base, layout):
    """The full state after loading is bitwise the one saved; the five steps after it
    stay within 1e-9 of the float64 reference, which passes through the saved state."""
    saved, path = base
    for res in run_3d(layout, load=True, path=path):
        for key, value in saved[0]["saved"].items():
            assert torch.equal(res["loaded"][key], value), key
        assert_matches(res["loaded"], ref_states()[SAVE_AT])
        assert_matches(res["final"], ref_states()[STEPS])


if __name__ == "__main__":
    pytest.main([__file__, "-x", "-q"])
