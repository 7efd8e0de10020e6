"""Tensor parallelism: dp=2 x tp=2 on 4 gloo processes, TP first, DMuon second, FSDP2 third;
and the ``tp`` ledger of a block of whole experts on tp=2 alone."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.collectives import CollectiveRecorder, FuncolBytes
from helpers.model import build_model, get_config, muon_predicate
from helpers.train import HPARAMS, global_batches, local_rows, loss_of, lr_lambda, reference_run

import dmuon
from dmuon.testing import run

STEPS, DP, TP = 10, 2, 2
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{n: ColwiseParallel() for n in COLWISE}, **{n: RowwiseParallel() for n in ROWWISE}}


def _train_tp(rank, world, path=None, save_at=None, load=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], _tp_plan())
    plan = dmuon.dedicate_params(model, mesh["dp"], predicate=muon_predicate)
    ignored = dmuon.ignored_params(model)  # FSDP2's own fully_shard, the public way
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], ignored_params=ignored)
    fully_shard(model, mesh=mesh["dp"], ignored_params=ignored)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    ledger, gathers, start = dmuon.get_ledger(model), [], 0
    dp_rank = mesh["dp"].get_local_rank()
    if load:
        extra = dmuon.checkpoint.load(path, model, opt)
        start = extra["step"]
        sched.load_state_dict(extra["sched"])
    for step, batch in enumerate(global_batches(STEPS)):
        if step < start:
            continue
        loss_of(model, local_rows(batch, dp_rank, DP)).backward()
        with CollectiveRecorder() as rec:
            opt.step()
        gathers.append([c for c in rec.calls if c.op.startswith("all_gather")])
        sched.step()
        opt.zero_grad()
        if save_at == step + 1:
            dmuon.checkpoint.save(path, model, opt,
                                  extra={"step": step + 1, "sched": sched.state_dict()})
    return {"full": dmuon.full_state_dict(model), "tp_bytes": ledger.last_step("tp", "step"),
            "gathers": gathers, "plan": plan.to_dict(), "dp_rank": dp_rank}


@functools.cache
def tp_run(path=None, save_at=None, load=False):
    return run(_train_tp, path, save_at, load, world_size=DP * TP)


def test_tp_matches_float64_reference():
    ref, _ = reference_run(STEPS)
    for rank, res in enumerate(tp_run()):
        for key, value in ref.items():
            err = ((res["full"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (rank, key, err)


def test_tp_communication_follows_the_gram_rule():
    shapes = {n: tuple(p.shape) for n, p in build_model(get_config("tiny"), device="meta")
              .named_parameters() if muon_predicate(n, p)}
    for res in tp_run():
        owned = [f for f, a in res["plan"]["params"].items() if a["owner"] == res["dp_rank"]]
        expected, gathered = 0, []
        for fqn in owned:
            rows, cols = shapes[fqn]
            split = 1 if any(f".{n}." in fqn for n in ROWWISE) else 0
            if (rows, cols)[split] >= (rows, cols)[1 - split]:
                # Gram: one m x m all-reduce per Gram computation, two with the restart
                m = (rows, cols)[1 - split]
                expected += 2 * 2 * (TP - 1) * m * m * 8 / TP
                assert res["plan"]["params"][fqn]["tp"] == "gram_allreduce"
            else:  # splits the shorter dim: gathered to the owners
                expected += (TP - 1) * rows * cols * 8 / TP
                gathered.append(rows * cols)  # the whole gathered matrix
                assert res["plan"]["params"][fqn]["tp"] == "gather"
        # the step's flags are summed over TP too (fp32, all-reduce): one per unit, per DP
        # rank and FSDP2's, then one after NS
        flags = len(res["plan"]["params"]) + DP + 1 + 1
        expected += 2 * (TP - 1) * flags * 4 / TP
        assert res["tp_bytes"] == expected
        for step_calls in res["gathers"]:
            assert sorted(c.numel for c in step_calls) == sorted(gathered)


def _wrong_order(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    dmuon.dedicate_params(model, mesh["dp"], predicate=muon_predicate)
    with pytest.raises(RuntimeError) as e:
        parallelize_module(model.model.layers[0], mesh["tp"], _tp_plan())
    return str(e.value)


def test_tp_after_dedicate_is_refused_by_name():
    for msg in run(_wrong_order, world_size=DP * TP):
        assert "'model.layers.0.self_attn.q_proj.weight'" in msg
        assert "after dmuon.dedicate_params" in msg


def test_tp_checkpoint_restart_is_bit_identical(tmp_path):
    path = str(tmp_path / "tp_ckpt")
    full = tp_run(path, save_at=5)
    resumed = tp_run(path, load=True)
    for a, b in zip(full, resumed):
        for key, value in a["full"].items():
            assert torch.equal(value, b["full"][key]), key


NAN_STEP, NAN_PARAM = 1, "model.layers.0.mlp.gate_proj.weight"


def _nan_on_one_peer(rank, world):
    """4 steps; at step 1 the gradient of one TP-sharded matrix is NaN on global rank 0
    only (dp 0, tp 0): its TP peer (dp 0, tp 1) and the other DP row saw nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], _tp_plan())
    dmuon.dedicate_params(model, mesh["dp"], predicate=muon_predicate)
    ignored = dmuon.ignored_params(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], ignored_params=ignored)
    fully_shard(model, mesh=mesh["dp"], ignored_params=ignored)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    step_now = [0]

    def poison(grad):
        if rank == 0 and step_now[0] == NAN_STEP:
            grad = grad.clone()
            grad.to_local()[0, 0] = float("nan")
        return grad

    model.get_parameter(NAN_PARAM).register_hook(poison)
    skipped, flagged = [], []
    for step, batch in enumerate(global_batches(4)):
        step_now[0] = step
        loss_of(model, local_rows(batch, mesh["dp"].get_local_rank(), DP)).backward()
        opt.step()
        opt.zero_grad()
        skipped.append(opt.skipped_steps)
        flagged.append(list(opt.nonfinite_ranks))
    full = dmuon.full_state_dict(model)
    return skipped, flagged, all(bool(v.isfinite().all()) for v in full.values())


def test_a_nan_in_one_tp_peers_shard_skips_the_step_on_every_rank():
    """Before the flags were summed over TP, the peer without the NaN went on to the
    Gram all-reduce its skipping peer never issued: a hang."""
    for rank, (skipped, flagged, finite) in enumerate(run(_nan_on_one_peer, world_size=4)):
        assert skipped == [0, 1, 1, 1], rank
        assert flagged[NAN_STEP] == [0], rank  # dp rank 0's gradient, named on every rank
        assert finite, rank


B, S, H = 2, 8, 16  # rows, whole sequence, hidden: the activation a whole-experts block moves


class _WholeExperts(torch.nn.Module):
    """A residual block whose MLP stays whole on every TP rank (as the experts of an MoE
    block do): its input all-gathered, its output cut back to the rank's sequence shard."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(H, H)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.SiLU(),
                                       torch.nn.Linear(2 * H, H))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.proj(x)
        return h + checkpoint(self.mlp, h, use_reentrant=False)


def _whole_experts_bytes(rank, world):
    """The ledger's ``tp`` bytes against the functional collectives DTensor issues."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = _WholeExperts().double()
    parallelize_module(model.mlp, mesh["tp"], PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
        use_local_output=True))
    dmuon.dedicate_params(model, mesh["dp"], predicate=lambda n, p: p.ndim == 2,
                          hook_boundary_strict=False)
    ledger, group = dmuon.get_ledger(model), mesh["tp"].get_group()
    x = torch.randn(B, S // world, H, dtype=torch.float64)  # this rank's sequence shard
    forward, backward = FuncolBytes(group), FuncolBytes(group)
    with forward:
        out = model(x)
    with backward:
        out.square().sum().backward()
    return {"forward": forward.bytes, "backward": backward.bytes,
            "ledger": {p: ledger.current("tp", p) for p in ("forward", "backward", "recompute")}}


def test_tp_bytes_of_a_whole_experts_block_are_the_collectives_dtensor_issues():
    """Both sides of its style are local tensors: before the ledger read the style's
    declared layouts it saw no DTensor there and counted none of the three all-gathers
    (the input's, forward and recomputed; the output gradient's, backward)."""
    gather = (TP - 1) / TP * B * S * H * 8
    for res in run(_whole_experts_bytes, world_size=TP):
        assert res["forward"] == res["ledger"]["forward"] == gather
        assert res["backward"] == res["ledger"]["backward"] + res["ledger"]["recompute"]
        assert res["ledger"]["backward"] == res["ledger"]["recompute"] == gather
