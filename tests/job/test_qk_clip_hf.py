"""QK-clip on Hugging Face Llama (GQA: 4 query heads over 2 key heads) through the
service's recording attention (``service.job.models.attention_logits``: transformers'
attention interface), against a single-process float64 reference written here: HF Llama
on plain SDPA, torch.optim.Muon + AdamW, the max logits computed by the test from each
attention's inputs and the Kimi K2 rule applied in loops (tests/helpers/qk_clip.py). 4 gloo
ranks, 10 steps, as Z3 1 x 4 (two micro-batches: the running max) and TP 1 x 2 x 2
(each TP rank records its own heads); then a step at lr 0, after which the clipped
heads' max logits, recomputed on that step's inputs, are tau. An architecture the clip
cannot bound (Qwen3's per-head q/k norms, Qwen2's biases, Mistral's window) is refused
naming ``optimizer.qk_clip``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_build import hf_causal_lm
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
    lr_lambda,
)

import dmuon
from dmuon.testing import run
from service.job.models.attention_logits import enable_qk_clip
from service.job.spec.field_types import SpecError

STEPS, SEED = 10, 5
TAU = 0.18  # this Llama's max logits run 0.18-0.22 under the clip: 2 to 6 of 8 heads clip
CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              use_cache=False)
LAYOUTS = {"z3": ((1, 4, 1), 2), "tp1x2x2": ((1, 2, 2), 1)}  # (R, N, T), micro-batches


def predicate(name, p):
    return ".layers." in name and p.ndim == 2


def llama(device=None):
    return hf_causal_lm("LlamaForCausalLM", CONFIG, seed=SEED, device=device)


def loss_of(model, tokens):
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _keep_attention_inputs(model) -> dict:
    seen = {}

    def keep(i, module, args, kwargs):
        cos, sin = kwargs["position_embeddings"]
        seen[i] = (kwargs["hidden_states"].detach(), cos.detach(), sin.detach())

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(functools.partial(keep, i),
                                                  with_kwargs=True)
    return seen


@torch.no_grad()
def step_maxima(model, inputs) -> list[list[float]]:
    """Each layer's per-head max logits on the attention inputs the forward kept."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    out = []
    for i, layer in enumerate(model.model.layers):
        x, cos, sin = inputs[i]
        attn, (b, t, _) = layer.self_attn, x.shape
        q = attn.q_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, -1, attn.head_dim).transpose(1, 2)
        out.append(causal_head_maxima(*apply_rotary_pos_emb(q, k, cos, sin)).tolist())
    return out


@functools.cache
def reference():
    """Final params, and per step the max logit and the heads clipped."""
    model = llama()
    inputs = _keep_attention_inputs(model)
    return reference_run(model, predicate, loss_of, lambda: step_maxima(model, inputs), TAU,
                         global_batches(STEPS))


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
               "mlp.up_proj")
    return {**{n: ColwiseParallel() for n in colwise},
            **{n: RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")}}


def _setup(layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard", "tp"))
    model = llama("meta")
    enable_qk_clip(model)
    if layout[2] > 1:
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], _tp_plan())
    dmuon.dedicate_params(model, mesh["shard"], predicate)
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh["shard"])
    dmuon.fully_shard(model, mesh=mesh["shard"])
    dmuon.materialize(model, seed=SEED, init_fn=model._init_weights)
    return mesh, model


def _train(rank, world, layout_id):
    layout, micro = LAYOUTS[layout_id]
    mesh, model = _setup(layout)
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64, qk_clip=TAU)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    dp, record = mesh["shard"].get_local_rank(), []
    for batch in global_batches(STEPS):
        for part in local_rows(batch, dp, layout[1]).chunk(micro):
            (loss_of(model, part) / micro).backward()
        opt.step()
        record.append((opt.max_logit, opt.clipped_heads))
        sched.step()
        opt.zero_grad()
    trained = dmuon.full_state_dict(model)
    for group in opt.param_groups:  # one more step that moves nothing but the clip
        group["lr"] = 0.0
    loss_of(model, local_rows(global_batches(STEPS + 1)[-1], dp, layout[1])).backward()
    opt.step()
    return trained, record, (opt.max_logit, opt.clipped_heads), dmuon.full_state_dict(model)


@functools.cache
def trained(layout_id: str):
    return run(_train, layout_id, world_size=4)


def test_the_reference_clips_at_every_step():
    _, record = reference()
    assert all(clipped for _, clipped in record), record  # the test can fail


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_qk_clip_on_hf_llama_matches_the_float64_reference(layout_id):
    ref, ref_record = reference()
    for rank, (full, record, _, _) in enumerate(trained(layout_id)):
        for key, value in ref.items():
            err = ((full[key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (layout_id, rank, key, err)
        assert_same_record(ref_record, record, (layout_id, rank))


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
@torch.no_grad()
def test_clipped_llama_heads_end_at_tau(layout_id):
    """A step at lr 0 moves nothing but the clip: on that step's attention inputs, the
    heads over tau end at tau and every other head is where it was."""
    results = trained(layout_id)
    before, _, _, after = results[0]
    model = llama()
    model.load_state_dict(before)
    inputs = _keep_attention_inputs(model)
    model(input_ids=global_batches(STEPS + 1)[-1][:, :-1])
    measured = step_maxima(model, inputs)
    model.load_state_dict(after)
    now = step_maxima(model, inputs)
    assert_clip_ends_at_tau(measured, now, [r[2] for r in results], TAU)


@pytest.mark.parametrize("arch, why", [
    ("Qwen3", "normalises q and k per head"), ("Qwen2", "q/k projection biases"),
    ("Mistral", "sliding window")])
def test_architectures_the_clip_cannot_bound_are_refused_by_name(arch, why):
    import transformers

    config = getattr(transformers, f"{arch}Config")(**CONFIG)
    with torch.device("meta"):
        model = getattr(transformers, f"{arch}ForCausalLM")._from_config(config)
    with pytest.raises(SpecError, match=f"optimizer.qk_clip: .*{why}"):
        enable_qk_clip(model)
