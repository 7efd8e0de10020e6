"""Pipeline parallelism (issue 52, the core): PP 2 x FSDP 2 on 4 gloo ranks under
torch.distributed.pipelining's schedules, every param within 1e-9 of the float64
single-process reference (torch.optim.Muon + AdamW on the global batch's mean loss)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.pipeline import CONFIG, pp_train
from helpers.train import reference_run

from dmuon.testing import run

STEPS = 10


def _merged(results: list[dict], key: str = "final") -> dict:
    """Each FQN's full value, checked equal on every rank that holds it."""
    out: dict = {}
    for r in results:
        for fqn, value in r[key].items():
            if fqn in out:
                assert (out[fqn] == value).all(), fqn
            out[fqn] = value
    return out


def _assert_matches_reference(results: list[dict]) -> None:
    expected, losses = reference_run(STEPS, config=CONFIG)
    got = _merged(results)
    assert sorted(got) == sorted(expected)
    for fqn, value in expected.items():
        err = ((got[fqn] - value).abs().max() / value.abs().max()).item()
        assert err <= 1e-9, (fqn, err)
    for r in results:  # the last stage's loss, the same on every rank
        assert r["losses"] == pytest.approx(losses, rel=1e-9)


def test_1f1b_pp2_fsdp2_matches_the_reference():
    results = run(pp_train, schedule="1f1b", world_size=4)
    _assert_matches_reference(results)
    for r in results:  # once per micro-batch without checkpointing
        assert list(r["layer_forwards"].values()) == [4 * STEPS * 2], r["layer_forwards"]


def test_pp2_tp2_matches_the_reference():
    """TP 2 inside each stage on 4 ranks (pp, shard 1, tp): every layer's projections
    split column then row as test_tp's, the stage's activations whole between stages."""
    results = run(pp_train, tp=2, world_size=4)
    _assert_matches_reference(results)
    for r in results:  # the matrices were split: NS's Gram sums or gathers went over tp
        assert all(ledger["tp"]["step"] > 0 for ledger in r["ledgers"].values())


@pytest.mark.parametrize("ac", ["checkpoint", "wrapper"])
def test_activation_checkpointing_inside_the_stages_matches_the_reference(ac):
    """Each layer recomputed in its micro-batch's backward (torch.utils.checkpoint, or
    torch's checkpoint_wrapper, whose FQN segment the state dicts leave out), Z3: the
    recomputation re-gathers what the forward freed. Each layer ran forward twice per
    micro-batch (4 micro-batches, 10 steps, 2 layers a stage)."""
    results = run(pp_train, ac=ac, z3=True, world_size=4)
    _assert_matches_reference(results)
    for r in results:
        assert list(r["layer_forwards"].values()) == [2 * 4 * STEPS * 2], r["layer_forwards"]


def test_pp2_hsdp2x2_matches_the_reference():
    """A 3-D layout (pp, replicate, shard) on 8 ranks: each stage HSDP 2 x 2."""
    _assert_matches_reference(run(pp_train, replicate=2, world_size=8))


def _reduce_bytes(rank, world, micro):
    out = pp_train(rank, world, schedule="gpipe", steps=2, micro=micro)  # 1F1B wants m >= 2
    return {i: ledger["shard"]["reduce"] for i, ledger in out["ledgers"].items()}


def test_the_reduce_goes_out_once_per_step_whatever_the_micro_batch_count():
    """The shard dim's reduce bytes of a step at 1 and at 8 micro-batches are equal:
    DMuon's reduce follows the schedule's last backward, not each micro-batch's."""
    one, eight = run(_reduce_bytes, 1, world_size=4), run(_reduce_bytes, 8, world_size=4)
    assert one == eight
    assert all(v > 0 for r in one for v in r.values())


@pytest.mark.parametrize("schedule,split", [("gpipe", "two"), ("interleaved", "four"),
                                            ("1f1b", "embedding_alone")],
                         ids=["gpipe", "interleaved_2_stages_per_rank", "stage_without_muon"])
def test_schedule_matches_the_reference(schedule, split):
    """GPipe; interleaved 1F1B with stages p and p + 2 on each rank (one PipelineMuon over
    both); and a first stage holding only the embedding (no Muon matrix)."""
    _assert_matches_reference(run(pp_train, schedule=schedule, split=split, world_size=4))


def _z2_and_z3(rank, world):
    return {z3: pp_train(rank, world, z3=z3, steps=4)["final"] for z3 in (False, True)}


def test_z3_equals_z2_bit_for_bit():
    for r in run(_z2_and_z3, world_size=4):
        assert r[False].keys() == r[True].keys()
        for fqn, value in r[False].items():
            assert torch.equal(r[True][fqn], value), fqn


NAN_STEP = 1
_HANDLES: list = []  # this process's hooks of the poisoned step


def _clear_hooks() -> None:
    for h in _HANDLES:
        h.remove()
    _HANDLES.clear()


def _nan_in_matrix(stages, step):
    """Rank 2 (stage 1, shard 0): NaN in its local gradient of one dedicated matrix."""
    _clear_hooks()
    if step == NAN_STEP and dist.get_rank() == 2:
        p = stages[0].submod.get_parameter("model.layers.2.mlp.down_proj.weight")
        _HANDLES.append(p.register_hook(lambda g: torch.full_like(g, float("nan"))))


def _nan_in_embedding(stages, step):
    """Rank 0 (stage 0, which holds the embedding alone): NaN in its FSDP2 gradient."""
    def poison_output(module, args, out):
        out.register_hook(lambda g: g * float("nan"))

    _clear_hooks()
    if step == NAN_STEP and dist.get_rank() == 0:
        embedding = stages[0].submod.model.embed_tokens
        _HANDLES.append(embedding.register_forward_hook(poison_output))


def _ns_overflow(stages, step):
    """Rank 2 (stage 1, shard 0): its Newton-Schulz overflows; every gradient is finite."""
    import dmuon.ns_schedule as ns_schedule

    def overflowing(*args, **kwargs):
        return _ns_overflow.saved(*args, **kwargs) * float("inf")

    if not hasattr(_ns_overflow, "saved"):
        _ns_overflow.saved = ns_schedule.newton_schulz
    poisoned = step == NAN_STEP and dist.get_rank() == 2
    ns_schedule.newton_schulz = overflowing if poisoned else _ns_overflow.saved


@pytest.mark.parametrize("split,poison", [("two", _nan_in_matrix),
                                          ("embedding_alone", _nan_in_embedding),
                                          ("two", _ns_overflow)],
                         ids=["matrix_in_stage_1", "embedding_in_a_stage_without_muon",
                              "update_in_stage_1"])
def test_a_nan_in_one_stage_skips_the_step_on_every_rank_of_every_stage(split, poison):
    results = run(pp_train, split=split, steps=3, poison=poison, world_size=4)
    for rank, r in enumerate(results):
        assert [bool(s) for s in r["skipped"]] == [False, True, False], (rank, r["skipped"])
        before, skipped, after = r["after"]
        for fqn, value in before.items():
            assert torch.equal(skipped[fqn], value), (rank, fqn)
            assert torch.isfinite(after[fqn]).all(), (rank, fqn)
        assert any(not torch.equal(after[k], v) for k, v in before.items()), rank


CLIP = 0.5


def _reference_norms(steps: int) -> list[float]:
    """Single process, the global batch: the total norm at each step, clipping applied."""
    from helpers.model import build_model, muon_predicate
    from helpers.train import global_batches, loss_of, lr_lambda, reference_ns, reference_optimizers

    model = build_model(CONFIG, dtype=torch.float64, seed=0)
    named = list(model.named_parameters())
    opts = reference_optimizers([p for n, p in named if muon_predicate(n, p)],
                                [p for n, p in named if not muon_predicate(n, p)])
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in opts]
    norms = []
    with reference_ns():
        for batch in global_batches(steps):
            loss_of(model, batch).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            for o, s in zip(opts, scheds):
                o.step()
                o.zero_grad()
                s.step()
    return norms


@pytest.mark.parametrize("schedule,split", [("1f1b", "two"), ("interleaved", "four")])
def test_clip_grad_norm_sums_over_the_stages(schedule, split):
    """PipelineMuon.clip_grad_norm_: the single-process total norm within 1e-12 (every
    stage's gradients, each divided by the micro-batch count, counted once)."""
    expected = _reference_norms(3)
    for r in run(pp_train, schedule=schedule, split=split, steps=3, clip=CLIP, world_size=4):
        assert r["norms"] == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("schedule,split,micro", [("1f1b", "two", 4), ("gpipe", "two", 8),
                                                  ("interleaved", "four", 4)])
def test_pp_bytes_are_the_activations_and_their_gradients(schedule, split, micro):
    """Per step and stage, on the ledger's pp dim: each micro-batch's activations
    (rows x SEQ x dim float64) sent forward by every stage but the last, and their
    gradients, of the same size, sent backward by every stage but the first."""
    from helpers.pipeline import DP, SPLITS
    from helpers.train import GLOBAL_BATCH, SEQ

    per_micro = (GLOBAL_BATCH // DP // micro) * SEQ * CONFIG.dim * 8
    last = len(SPLITS[split]) - 1
    for r in run(pp_train, schedule=schedule, split=split, steps=2, micro=micro,
                 world_size=4):
        for stage, ledger in r["ledgers"].items():
            pp = ledger["pp"]
            assert pp.get("forward", 0) == (micro * per_micro if stage < last else 0), stage
            assert pp.get("backward", 0) == (micro * per_micro if stage > 0 else 0), stage


def _stage_defaults(rank, world):
    from helpers.model import build_model, muon_predicate
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_model(CONFIG, dtype=torch.float64, seed=0)
    dmuon.dedicate_stage(model, mesh, muon_predicate)
    return dmuon.get_state(model).reshard_after_forward


def test_dedicate_stage_is_z2_by_default():
    """Z3 would re-gather every matrix for each micro-batch's backward."""
    assert run(_stage_defaults, world_size=2) == [False, False]


def test_zero_bubble_schedules_are_refused_by_name():
    """Their weight pass (autograd.grad) leaves .grad alone, which DMuon's hooks read."""
    with pytest.raises(Exception, match="zero-bubble schedules"):
        run(pp_train, schedule="zero_bubble", split="four", steps=1, world_size=4)
