"""Pipeline parallelism with expert parallelism inside the stages (issue 52): the EP
tests' MoE (2 layers of 8 experts, top 2, the ``layers.{i}.experts`` 3-D weights), cut
into 2 stages that keep its FQNs (the embedding and layer 0; layer 1 and the head), on
4 gloo ranks as PP 2 x (EP 2 over each stage's 2-rank shard group), built on the meta
device and materialised per stage, 4 micro-batches under 1F1B. Against test_expert_
parallel's single-process float64 reference (one 2-D parameter per expert, every token
through its experts in a loop; at step 4 no token reaches expert 5): every param within
1e-9 and the pipeline's clip norm within 1e-9 at every step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.train import HPARAMS, local_rows, lr_lambda
from test_expert_parallel import (
    LAYERS,
    NO_CLIP,
    ROWS,
    SEED,
    VOCAB,
    D,
    E,
    batches,
    is_boundary,
    is_muon,
    net,
    reference,
)
from torch import nn

import dmuon
from dmuon.testing import run

PP, SHARD, EP, MICRO = 2, 2, 2, 4
SEQ = 8  # batches() rows are 9 tokens: 8 in, 8 targets


class MoEStage(nn.Module):
    """Stage ``index`` of the MoE under its original FQNs (``layers.1`` stays
    ``layers.1``): the first holds the embedding, the last the head."""

    def __init__(self, full: nn.Module, index: int):
        super().__init__()
        self.first, self.last = index == 0, index == PP - 1
        if self.first:
            self.embed = full.embed
        per = LAYERS // PP
        self.layers = nn.ModuleDict({str(i): full.layers[i]
                                     for i in range(index * per, (index + 1) * per)})
        if self.last:
            self.head = full.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.first else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.last else h


def _stage(mesh, z3: bool):
    with torch.device("meta"):
        full = net().double()
    p = mesh["pp"].get_local_rank()
    module = MoEStage(full, p)
    ep_group = dmuon.shard_experts(module, is_muon, mesh["shard"], ep_size=EP)
    dmuon.dedicate_stage(module, mesh["shard"], is_muon, hook_boundary_predicate=is_boundary,
                         reshard_after_forward=z3)
    for layer in module.layers.values():
        dmuon.fully_shard(layer, mesh=mesh["shard"], reshard_after_forward=z3)
    dmuon.fully_shard(module, mesh=mesh["shard"], reshard_after_forward=z3)
    dmuon.materialize(module, seed=SEED)
    for layer in module.layers.values():
        layer.ep_group, layer.ledger = ep_group, dmuon.get_ledger(module)
    rows = ROWS // SHARD // MICRO
    act = torch.empty(rows, SEQ, D, dtype=torch.float64, requires_grad=True)
    inp = torch.zeros(rows, SEQ, dtype=torch.long) if p == 0 else act
    out = torch.empty(rows, SEQ, VOCAB, dtype=torch.float64) if p == PP - 1 else act
    return dmuon.PipelineStage(module, p, PP, torch.device("cpu"), input_args=inp,
                               output_args=out, group=mesh["pp"].get_group())


def _loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _train(rank, world, z3=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import Schedule1F1B

    mesh = init_device_mesh("cpu", (PP, SHARD), mesh_dim_names=("pp", "shard"))
    stage = _stage(mesh, z3)
    opt = dmuon.PipelineMuon([stage], **HPARAMS, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=_loss)
    d, norms, losses = mesh["shard"].get_local_rank(), [], []
    for batch, ban in batches():
        for layer in stage.submod.layers.values():
            layer.banned = ban
        rows, micro_losses = local_rows(batch, d, SHARD), []
        kwargs = {"target": rows[:, 1:], "losses": micro_losses} if stage.is_last else {}
        schedule.step(*((rows[:, :-1],) if stage.is_first else ()), **kwargs)
        norms.append(opt.clip_grad_norm_(NO_CLIP).item())
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(opt.step_loss(micro_losses))
    ledger = dmuon.get_ledger(stage.submod).last_step_by_phase()
    return {"full": dmuon.full_state_dict(stage.submod), "norms": norms, "ep": ledger["ep"],
            "local_experts": [layer.experts.up.shape[0]
                              for layer in stage.submod.layers.values()]}


@pytest.mark.parametrize("z3", [True, False], ids=["z3", "z2"])
def test_pp2_ep2_matches_the_float64_reference(z3):
    ref, norms = reference()
    results = run(_train, z3, world_size=PP * SHARD)
    got: dict = {}
    for rank, res in enumerate(results):
        assert res["local_experts"] == [E // EP] * (LAYERS // PP), rank
        assert res["ep"]["forward"] > 0 and res["ep"]["backward"] > 0, res["ep"]
        assert res["norms"] == pytest.approx(norms, rel=1e-9, abs=0), rank
        for key, value in res["full"].items():
            assert key not in got or torch.equal(got[key], value), (rank, key)
            got[key] = value
    assert set(got) == set(ref)
    for key, value in ref.items():
        err = ((got[key] - value).abs().max() / value.abs().max()).item()
        assert err <= 1e-9, (key, err)
