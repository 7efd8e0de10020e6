"""QK-clip (``dmuon.Muon(qk_clip=tau)``) against a single-process float64 reference
written here: torch.optim.Muon + AdamW (tests/helpers/train.py), then the Kimi K2 report's
per-head rule with this project's GQA split, applied in plain loops to max logits the
test computes itself (the full causal logit matrix of each attention's input, measured
in the step's forward). 4 gloo ranks, 10 steps, on Z3 1 x 4 (two micro-batches: the
running max), HSDP 2 x 2 under non-reentrant activation checkpointing (a recomputed
forward must not change the maxima) and TP 1 x 2 x 2 under reentrant checkpointing
(each TP rank its own heads; a first pass without grad); then a step at lr 0,
after which the clipped heads' max logits, recomputed on that step's inputs, are tau."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.model import apply_rope, build_model, get_config, muon_predicate
from helpers.qk_clip import (
    assert_clip_ends_at_tau,
    assert_same_record,
    causal_head_maxima,
    reference_run,
)
from helpers.train import (
    HPARAMS,
    global_batches,
    local_rows,
    loss_of,
    lr_lambda,
)

import dmuon
from dmuon.testing import run

STEPS = 10
TAU = 0.1  # the tiny model's max logits run 0.11-0.19: 1 to 6 of its 8 heads clip per step


def head_max_logits(attn, x, cos, sin) -> torch.Tensor:
    b, t, _ = x.shape
    d = attn.head_dim
    q = apply_rope(attn.q_proj(x).view(b, t, -1, d).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(b, t, -1, d).transpose(1, 2), cos, sin)
    return causal_head_maxima(q, k)


def _keep_attention_inputs(model) -> dict:
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, i=i: seen.__setitem__(i, tuple(a.detach() for a in args)))
    return seen


@functools.cache
def reference():
    """Final params, and per step the max logit and the heads clipped (measured in the
    step's forward, as the report does, and applied after the update)."""
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    inputs = _keep_attention_inputs(model)
    return reference_run(model, muon_predicate, loss_of, lambda: step_maxima(model, inputs), TAU,
                         global_batches(STEPS))


@torch.no_grad()
def step_maxima(model, inputs) -> list[list[float]]:
    """Each layer's per-head max logits on the attention inputs the forward kept."""
    return [head_max_logits(layer.self_attn, *inputs[i]).tolist()
            for i, layer in enumerate(model.model.layers)]


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
               "mlp.up_proj")
    return {**{n: ColwiseParallel() for n in colwise},
            **{n: RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")}}


LAYOUTS = {"z3": ((1, 4, 1), 2, None), "hsdp2x2": ((2, 2, 1), 1, "non_reentrant"),
           "tp1x2x2": ((1, 2, 2), 1, "reentrant")}


def _model_on(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    (R, N, T), _, checkpointing = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (R, N, T), mesh_dim_names=("replicate", "shard", "tp"))
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    model.model.activation_checkpointing = checkpointing
    if T > 1:
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], _tp_plan())
    dmuon.dedicate_params(model, mesh["shard"], muon_predicate,
                          replicate_mesh=mesh["replicate"] if R > 1 else None)
    fsdp_mesh = mesh["replicate", "shard"] if R > 1 else mesh["shard"]
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=fsdp_mesh)
    dmuon.fully_shard(model, mesh=fsdp_mesh)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64, qk_clip=TAU)
    dp = mesh["replicate"].get_local_rank() * N + mesh["shard"].get_local_rank()
    return model, opt, dp, R * N


def _refusals(model) -> list[str]:
    """What ``dmuon.Muon`` says to a tau that is not one."""
    said = []
    for tau in (0, -1.0, float("nan"), "100"):
        try:
            dmuon.Muon(model, qk_clip=tau)
        except ValueError as e:
            said.append(str(e))
    return said


def _train(rank, world, layout):
    model, opt, dp, dp_size = _model_on(layout)
    refusals = _refusals(model)
    micro = LAYOUTS[layout][1]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    record = []
    for batch in global_batches(STEPS):
        for part in local_rows(batch, dp, dp_size).chunk(micro):
            (loss_of(model, part) / micro).backward()
        opt.step()
        record.append((opt.max_logit, opt.clipped_heads))
        sched.step()
        opt.zero_grad()
    trained = dmuon.full_state_dict(model)
    for group in opt.param_groups:  # one more step that moves nothing but the clip
        group["lr"] = 0.0
    loss_of(model, local_rows(global_batches(STEPS + 1)[-1], dp, dp_size)).backward()
    opt.step()
    last = (opt.max_logit, opt.clipped_heads)
    return trained, record, last, dmuon.full_state_dict(model), refusals


@functools.cache
def trained(layout: str):
    return run(_train, layout, world_size=4)


def test_the_reference_clips_at_most_steps():
    _, record = reference()
    assert sum(1 for _, clipped in record if clipped) >= 8, record  # the test can fail


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qk_clip_matches_the_float64_reference(layout):
    ref, ref_record = reference()
    results = trained(layout)
    for rank, (full, *_) in enumerate(results):
        for key, value in ref.items():
            err = ((full[key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (layout, rank, key, err)
    for rank, (_, record, *_) in enumerate(results):  # TP peers' heads counted together
        assert_same_record(ref_record, record, (layout, rank))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@torch.no_grad()
def test_clipped_heads_end_at_tau(layout):
    """A step at lr 0 moves nothing but the clip: on that step's attention inputs, the
    heads over tau end at tau and every other head is where it was."""
    results = trained(layout)
    before, _, _, after, _ = results[0]
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    model.load_state_dict(before)
    inputs = _keep_attention_inputs(model)
    model(global_batches(STEPS + 1)[-1][:, :-1])
    measured = step_maxima(model, inputs)
    model.load_state_dict(after)
    now = step_maxima(model, inputs)
    assert_clip_ends_at_tau(measured, now, [r[2] for r in results], TAU)


def test_without_qk_clip_the_reference_ends_elsewhere():
    """The reference is sensitive to the clip: without it, other params."""
    from helpers.train import reference_run

    plain, _ = reference_run(STEPS)
    ref, _ = reference()
    assert max((plain[k] - ref[k]).abs().max().item() for k in ref) > 1e-4


def test_a_tau_that_is_not_one_is_refused_by_name():
    refusals = trained("z3")[0][4]
    assert len(refusals) == 4 and all("qk_clip must be tau > 0" in r for r in refusals)


@pytest.mark.parametrize("slab", [2 ** 26, 50])
def test_max_logits_in_slabs_match_the_whole_causal_matrix(monkeypatch, slab):
    """Cut into slabs of a few query tokens or not, the per-head maxima are those of
    the whole causal logit matrix (GQA: 6 query heads over 2 key heads)."""
    monkeypatch.setattr(dmuon.qk_clip, "_SLAB", slab)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 9, 8, dtype=torch.float64, generator=g)
    k = torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=g)
    # a large logit on a masked pair (query 0, key 8) must not count
    q[:, :, 0], k[:, :, 8] = 10.0, 10.0
    expected = causal_head_maxima(q, k)
    assert torch.allclose(dmuon.qk_clip.max_logits(q, k), expected, rtol=1e-14, atol=0)
    assert expected.max() < 10.0 * 10.0 * 8 / math.sqrt(8)


def test_only_forwards_with_grad_count_and_zero_grad_or_a_skip_drops_them():
    """An evaluation forward (no grad) records nothing, a training forward does;
    ``zero_grad`` and a skipped step drop what was recorded."""
    model = build_model(get_config("tiny"), dtype=torch.float64, seed=0)
    clip = dmuon.qk_clip.QKClip(model, TAU, {})
    tokens = global_batches(1)[0][:, :-1]
    with torch.no_grad():
        model(tokens)
    with pytest.raises(RuntimeError, match="'model.layers.0.self_attn' recorded no max"):
        clip.clip([], None, skip=False)
    model(tokens)
    clip.discard()  # what zero_grad does
    with pytest.raises(RuntimeError, match="recorded no max logits"):
        clip.clip([], None, skip=False)
    model(tokens)
    clip.clip([], None, skip=True)  # a skipped step: no record, and its maxima dropped
    assert (clip.max_logit, clip.clipped_heads) == (None, 0)
    with pytest.raises(RuntimeError, match="recorded no max logits"):
        clip.clip([], None, skip=False)
    model(tokens)
    clip.clip([], None, skip=False)  # no group: nothing sent; the record is this rank's
    assert clip.max_logit > TAU and clip.clipped_heads > 0
