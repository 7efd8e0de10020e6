"""HF Llama (grouped-query attention) under HSDP x TP on 4 gloo ranks, as 2 x 1 x 2 and
1 x 2 x 2: built on the meta device, tensor-parallelised there, dedicated, fully sharded
and ``dmuon.materialize``d; the initial values equal one process's init, the peak of
what a rank allocates stays below one block's full size plus its share, ten float64
steps match torch.optim.Muon + AdamW in one process, and the ledger's ``tp`` bytes are
the activation collectives and Gram all-reduces counted by hand (and by a dispatch mode
that sees every functional collective DTensor issues)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.collectives import FuncolBytes
from helpers.hf_build import hf_causal_lm
from helpers.memory import peak_live_bytes
from helpers.train import HPARAMS, lr_lambda, reference_optimizers, reference_train

import dmuon
from dmuon.testing import run

STEPS, ROWS, SEQ, SEED = 10, 8, 16, 5
CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              use_cache=False)
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
LAYOUTS = {"2x1x2": (2, 1, 2), "1x2x2": (1, 2, 2)}


def predicate(name, p):
    return ".layers." in name and p.ndim == 2


def llama(device=None):
    return hf_causal_lm("LlamaForCausalLM", CONFIG, seed=SEED, device=device)


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{n: ColwiseParallel() for n in COLWISE}, **{n: RowwiseParallel() for n in ROWWISE}}


def batches():
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, CONFIG["vocab_size"], (ROWS, SEQ + 1), generator=g)
            for _ in range(STEPS)]


def loss_of(model, tokens):
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def setup(layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", layout, mesh_dim_names=("replicate", "shard", "tp"))
    model = llama("meta")
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], tp_plan())
    dmuon.dedicate_params(model, mesh["shard"], predicate, replicate_mesh=mesh["replicate"])
    dp_mesh = mesh["replicate", "shard"]
    for layer in model.model.layers:
        dmuon.fully_shard(layer, mesh=dp_mesh)
    dmuon.fully_shard(model, mesh=dp_mesh)
    dmuon.materialize(model, seed=SEED, init_fn=model._init_weights)
    return mesh, model


def train(rank, world, layout):
    (mesh, model), peak = peak_live_bytes(lambda: setup(layout))
    out = {"initial": dmuon.full_state_dict(model), "peak": peak,
           "share": sum(dmuon.memory_report(model).values())}
    opt = dmuon.Muon(model, **HPARAMS, ns_dtype=torch.float64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    r, s = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()
    dp, dp_size = r * mesh["shard"].size() + s, mesh["replicate"].size() * mesh["shard"].size()
    per = ROWS // dp_size
    for step, tokens in enumerate(batches()):
        counter = FuncolBytes(mesh["tp"].get_group()) if step == STEPS - 1 else None
        with counter if counter is not None else contextlib.nullcontext():
            loss_of(model, tokens[dp * per:(dp + 1) * per]).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    out["observed_tp_activation_bytes"] = counter.bytes
    out["ledger"] = dmuon.get_ledger(model).last_step_by_phase()
    out["final"] = dmuon.full_state_dict(model)
    out["plan"] = dmuon.get_plan(model).to_dict()
    out["dp"] = dp
    return out


@functools.cache
def results(layout_id):
    layout = LAYOUTS[layout_id]
    return run(train, layout, world_size=layout[0] * layout[1] * layout[2])


@functools.cache
def reference():
    model = llama()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    muon = [p for n, p in model.named_parameters() if predicate(n, p)]
    others = [p for n, p in model.named_parameters() if not predicate(n, p)]
    final, _ = reference_train(model, reference_optimizers(muon, others), batches(),
                               loss=loss_of)
    return initial, final


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_meta_init_under_tp_equals_one_process_init(layout_id):
    initial, _ = reference()
    for res in results(layout_id):
        assert set(res["initial"]) == set(initial)
        for key, value in initial.items():
            assert torch.equal(res["initial"][key], value), key


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_meta_init_under_tp_allocates_below_a_block_plus_the_share(layout_id):
    full = llama("meta")
    block = sum(p.numel() * 8 for p in full.model.layers[0].parameters())
    whole = sum(p.numel() * 8 for p in full.parameters())
    for res in results(layout_id):
        # the rank's share: its TP shards of its column's matrices, its FSDP2 shards; the
        # whole model never exists on it
        assert res["peak"] < block + res["share"], (res["peak"], block, res["share"])
        assert res["peak"] < whole, (res["peak"], whole)


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_llama_gqa_3d_matches_float64_reference(layout_id):
    _, final = reference()
    for res in results(layout_id):
        for key, value in final.items():
            err = ((res["final"][key] - value).abs().max() / value.abs().max()).item()
            assert err <= 1e-9, (layout_id, key, err)


def _activation_bytes(rows: int, T: int) -> float:
    """Per block, with plain colwise/rowwise TP (no sequence parallel), on [rows, SEQ,
    hidden] float64 activations: forward, o_proj and down_proj each all-reduce their
    Partial output; backward, q/k/v and gate/up each all-reduce the Partial gradient of
    their replicated input. Seven all-reduces of S bytes, 2(T-1)/T x S each."""
    S = rows * SEQ * CONFIG["hidden_size"] * 8
    return CONFIG["num_hidden_layers"] * 7 * 2 * (T - 1) / T * S


def _gram_bytes(owned: list[str], T: int) -> float:
    """Per owned matrix: Gram NS over the TP shards all-reduces an m x m Gram matrix
    twice (the restart), m the unsplit dim, when the split dim is the longer; else the
    shards are all-gathered ((T-1)/T of the whole matrix)."""
    h, i = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    kv = h // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    total = 0.0
    for fqn in owned:
        name = fqn.split(".")[-2]
        rows, cols = shapes[name]
        split = 1 if name in ("o_proj", "down_proj") else 0
        split_len, other = (rows, cols)[split], (rows, cols)[1 - split]
        total += 2 * 2 * (T - 1) / T * other * other * 8 if split_len >= other \
            else (T - 1) / T * rows * cols * 8
    return total


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_ledger_tp_bytes_are_the_activation_collectives_and_gram_all_reduces(layout_id):
    R, N, T = LAYOUTS[layout_id]
    rows = ROWS // (R * N)
    for res in results(layout_id):
        tp = res["ledger"]["tp"]
        activations = tp.get("forward", 0) + tp.get("backward", 0)
        assert activations == pytest.approx(_activation_bytes(rows, T), rel=1e-12)
        assert res["observed_tp_activation_bytes"] == pytest.approx(activations, rel=1e-12)
        owned = [f for f, a in res["plan"]["params"].items() if a["owner"] == res["dp"]]
        # and the step's fp32 flags, summed over TP too: per unit, per DP rank, FSDP2's,
        # then one after NS
        flags = len(res["plan"]["params"]) + R * N + 1 + 1
        assert tp["step"] == pytest.approx(_gram_bytes(owned, T) + 2 * (T - 1) / T * flags * 4,
                                           rel=1e-12)
