"""The service's tensor-parallel plans (service/job/models/tp_plans.py), sequence parallel on the
norms: the built-in model, HF Llama and HF Qwen3 on 4 gloo ranks as 1 x 2 x 2 and
2 x 1 x 2, built on meta and materialised, ten float64 steps against one process running
torch.optim.Muon (float64 NS) + AdamW on the whole batch, with no warning from FSDP2 of a
view returned; and the degrees that cannot split a model, refused by the module's name."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_build import hf_causal_lm
from helpers.train import HPARAMS, lr_lambda, reference_optimizers, reference_train

import dmuon
from dmuon.testing import run
from service.job.models import builtin
from service.job.models.build import logits_of
from service.job.models.builtin import causal_lm_loss, vocab_parallel
from service.job.models.tp_plans import apply_tp, check_tp_degree, tp_plan

STEPS, ROWS, SEQ, SEED = 6, 8, 16, 3
HF = {"llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64, use_cache=False),
      "qwen3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64, use_cache=False, tie_word_embeddings=False)}
BUILTIN = builtin.ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              ffn_dim=128, max_seq_len=64)
CASES = {"builtin-1x2x2": ("builtin", (1, 2, 2)), "llama-2x1x2": ("llama", (2, 1, 2)),
         "qwen3-1x2x2": ("qwen3", (1, 2, 2))}


def predicate(name, p):
    return ".layers." in name and p.ndim == 2


def make(kind: str, device=None):
    if kind == "builtin":
        return builtin.build_model(BUILTIN, dtype=torch.float64, device=device or "cpu",
                                   seed=None if device == "meta" else SEED)
    name = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[kind]
    return hf_causal_lm(name, HF[kind], seed=SEED, device=device)


def init_fn(kind, model):
    return builtin.init_builtin if kind == "builtin" else model._init_weights


def batches():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (ROWS, SEQ + 1), generator=g) for _ in range(STEPS)]


def loss_of(model, tokens):
    logits = logits_of(model, tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def sharded_loss_and_backward(model, tokens, tp: int) -> torch.Tensor:
    """The workers' loss: the head's vocabulary shards reduced inside the cross-entropy,
    forward and backward under loss_parallel."""
    with vocab_parallel(tp):
        loss = causal_lm_loss(logits_of(model, tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
    return loss


def train(rank, world, kind, layout):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard", "tp"))
    model = make(kind, "meta")
    apply_tp(model, mesh["tp"])
    dmuon.dedicate_params(model, mesh["shard"], predicate, replicate_mesh=mesh["replicate"])
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=mesh["replicate", "shard"])
    dmuon.fully_shard(model, mesh=mesh["replicate", "shard"])
    dmuon.materialize(model, seed=SEED, init_fn=init_fn(kind, model))
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    dp, per = r * layout[1] + s, ROWS // (layout[0] * layout[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tokens in batches():
            sharded_loss_and_backward(model, tokens[dp * per:(dp + 1) * per], layout[2])
            opt.step()
            sched.step()
            opt.zero_grad()
    return {"final": dmuon.full_state_dict(model), "warnings": [str(w.message) for w in caught],
            "ledger": dmuon.get_ledger(model).last_step_by_phase()}


@functools.cache
def reference(kind):
    model = make(kind)
    muon = [p for n, p in model.named_parameters() if predicate(n, p)]
    others = [p for n, p in model.named_parameters() if not predicate(n, p)]
    final, _ = reference_train(model, reference_optimizers(muon, others), batches(),
                               loss=loss_of)
    return final


@pytest.mark.parametrize("case", list(CASES))
def test_tp_plan_with_sequence_parallel_matches_float64_reference(case):
    kind, layout = CASES[case]
    ref = reference(kind)
    for res in run(train, kind, layout, world_size=layout[0] * layout[1] * layout[2]):
        for key, value in ref.items():
            err = ((res["final"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (case, key, err)
        # the logits stay a DTensor (sharded on the vocabulary), no local view: FSDP2 has
        # no in-place hazard to warn of
        assert not [w for w in res["warnings"] if "returned a view tensor" in w], case
        tp = res["ledger"]["tp"]
        # sequence parallel: all-gathers and reduce-scatters of activations both ways
        assert tp["forward"] > 0 and tp["backward"] > 0 and tp["step"] > 0


def test_degrees_that_cannot_split_the_model_are_refused_by_module():
    """The tightest split T misses is named: 3 divides neither the 4 heads nor the 2 KV
    heads, and the KV heads bound T; 1 and 2 divide 4 heads, 2 KV heads, FFN 128 and
    vocabulary 256."""
    llama = make("llama", "meta")
    fitting = r"; the degrees that divide every split of this model: 1, 2$"
    with pytest.raises(ValueError, match=r"tp = 3 does not divide the 2 KV heads of "
                                         r"'model.layers.0.self_attn.k_proj'" + fitting):
        check_tp_degree(llama, 3)
    with pytest.raises(ValueError, match=r"tp = 4 does not divide the 2 KV heads of "
                                         r"'model.layers.0.self_attn.k_proj'" + fitting):
        check_tp_degree(llama, 4)
    check_tp_degree(llama, 2)

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    assert tp_plan(Plain()) is None
    with pytest.raises(ValueError, match="no tensor-parallel plan for Plain"):
        check_tp_degree(Plain(), 2)


def _head_gradients(rank, world, kind, sharded: bool):
    """One forward and backward of the 1 x 1 x 2 TP model (no DMuon): the loss and every
    param's full gradient, with the head's logits sharded (loss parallel) or gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from service.job.models.tp_plans import tp_plan

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = make(kind)
    plan = tp_plan(model)
    if not sharded:
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    with torch.no_grad():
        placements = getattr(logits_of(model, batches()[0][:, :-1]), "placements", None)
    loss = sharded_loss_and_backward(model, batches()[0], world)
    return loss.detach(), {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                               else p.grad) for n, p in model.named_parameters()}, placements


@pytest.mark.parametrize("kind", ["builtin", "llama"])
def test_the_vocabulary_sharded_head_gives_the_replicated_heads_loss_and_gradients(kind):
    sharded = run(_head_gradients, kind, True, world_size=2)
    gathered = run(_head_gradients, kind, False, world_size=2)
    for (loss, grads, placements), (ref_loss, ref_grads, gathered_as) in zip(sharded, gathered):
        assert str(placements) == "(Shard(dim=2),)" and gathered_as is None  # logits' forms
        assert abs(loss.item() - ref_loss.item()) <= 1e-9 * abs(ref_loss.item())
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            err = ((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max()).item()
            assert err <= 1e-9, (kind, name, err)
