"""Tensor-parallel plans, one per architecture, in torchtitan's layout: colwise q/k/v and
gate/up, rowwise o/down, sequence parallel on the norms (activations between blocks are
sharded on the sequence dim; each attention and MLP all-gathers its input and
reduce-scatters its output). Applied with ``parallelize_module`` on the ``tp`` mesh
before ``dmuon.dedicate_params``.

A user factory's model brings its own plan as a ``tp_plan()`` method returning
``{fqn pattern: ParallelStyle}``; a model without one cannot run with ``layout.tp > 1``.
Mixture-of-experts blocks keep their experts whole on every TP rank (their input
all-gathered, their output's sequence shard taken locally): only attention is split.
"""

from __future__ import annotations

import math

from torch import nn


def _styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    return dict(Replicate=Replicate, Shard=Shard, Colwise=ColwiseParallel,
                Rowwise=RowwiseParallel, SP=SequenceParallel, Input=PrepareModuleInput,
                InputOutput=PrepareModuleInputOutput)


def _outer(s, embed: str, norm: str, head: str) -> dict:
    """Embedding out as sequence shards, the final norm on them, and the head's logits
    left sharded on the vocabulary (a DTensor) for the loss to take them as they are
    (``torch.distributed.tensor.parallel.loss_parallel``, torchtitan's loss parallel):
    gathered, every TP rank held the whole ``[rows, seq, vocab]`` and its fp32 copy."""
    return {embed: s["Rowwise"](input_layouts=s["Replicate"](), output_layouts=s["Shard"](1)),
            norm: s["SP"](use_local_output=True),
            head: s["Colwise"](input_layouts=s["Shard"](1), output_layouts=s["Shard"](-1),
                               use_local_output=False)}


def _attention(s, layers: str, kwarg: bool, qk_norm: bool) -> dict:
    gather = (s["Input"](input_kwarg_layouts={"hidden_states": s["Shard"](1)},
                         desired_input_kwarg_layouts={"hidden_states": s["Replicate"]()})
              if kwarg else
              s["Input"](input_layouts=(s["Shard"](1), None, None),
                         desired_input_layouts=(s["Replicate"](), None, None)))
    plan = {f"{layers}.input_layernorm": s["SP"](use_local_output=True),
            f"{layers}.self_attn": gather,
            f"{layers}.self_attn.o_proj": s["Rowwise"](output_layouts=s["Shard"](1))}
    plan.update({f"{layers}.self_attn.{p}": s["Colwise"]() for p in ("q_proj", "k_proj",
                                                                     "v_proj")})
    if qk_norm:  # per-head norms over local heads: weights replicated, gradients summed
        plan.update({f"{layers}.self_attn.{n}": s["SP"](sequence_dim=2, use_local_output=True)
                     for n in ("q_norm", "k_norm")})
    return plan


def _dense_mlp(s, layers: str) -> dict:
    return {f"{layers}.post_attention_layernorm": s["SP"](use_local_output=True),
            f"{layers}.mlp": s["Input"](input_layouts=(s["Shard"](1),),
                                        desired_input_layouts=(s["Replicate"](),)),
            f"{layers}.mlp.gate_proj": s["Colwise"](), f"{layers}.mlp.up_proj": s["Colwise"](),
            f"{layers}.mlp.down_proj": s["Rowwise"](output_layouts=s["Shard"](1))}


def _whole_experts(s, layers: str) -> dict:
    """The block's input gathered, its full output cut to this rank's sequence shard
    (no traffic); its gradient is all-gathered back in the backward."""
    return {f"{layers}.post_attention_layernorm": s["SP"](use_local_output=True),
            f"{layers}.mlp": s["InputOutput"](
                input_layouts=(s["Shard"](1),), desired_input_layouts=(s["Replicate"](),),
                use_local_input=True, output_layouts=(s["Replicate"](),),
                desired_output_layouts=(s["Shard"](1),), use_local_output=True)}


_HF = {"llama": (False, "dense"), "qwen2": (False, "dense"), "qwen3": (True, "dense"),
       "qwen3_moe": (True, "experts")}


def tp_plan(model: nn.Module) -> dict | None:
    """``{fqn pattern: ParallelStyle}`` for ``model``, or None where no plan is known."""
    own = getattr(model, "tp_plan", None)
    if callable(own):
        return own()
    s = _styles()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _HF:
        qk_norm, mlp = _HF[model_type]
        kwarg = True
    elif type(model).__name__ == "LlamaForCausalLM" and hasattr(model.config, "n_kv_heads"):
        # the built-in model; its MoE variant keeps its experts whole, as Qwen3-MoE's
        qk_norm, kwarg = False, False
        mlp = "experts" if getattr(model.config, "experts", 0) else "dense"
    else:
        return None
    layers = "model.layers.*"
    plan = {**_outer(s, "model.embed_tokens", "model.norm", "lm_head"),
            **_attention(s, layers, kwarg, qk_norm)}
    plan.update(_dense_mlp(s, layers) if mlp == "dense" else _whole_experts(s, layers))
    return plan


def _heads(model: nn.Module) -> tuple[int, int] | None:
    c = getattr(model, "config", None)
    for q, kv in (("num_attention_heads", "num_key_value_heads"), ("n_heads", "n_kv_heads")):
        if hasattr(c, q):
            return getattr(c, q), getattr(c, kv, None) or getattr(c, q)
    return None


def _split_sizes(model: nn.Module) -> list[tuple[str, str, int]]:
    """(module FQN, what, count) that a TP degree must divide, heads first."""
    out, last = [], []
    heads = _heads(model)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if heads and leaf == "q_proj":
            out.append((name, "attention heads", heads[0]))
        elif heads and leaf in ("k_proj", "v_proj"):
            out.append((name, "KV heads", heads[1]))
        elif leaf in ("gate_proj", "up_proj") and isinstance(module, nn.Linear):
            out.append((name, "FFN width", module.out_features))
        elif leaf == "embed_tokens" and isinstance(module, nn.Embedding):
            last.append((name, "vocabulary rows", module.num_embeddings))
    return out + last


def check_tp_degree(model: nn.Module, tp: int) -> None:
    """Refuse a TP degree that does not split every sharded module evenly, naming the
    first such module, or a model without a plan."""
    if tp == 1:
        return
    if tp_plan(model) is None:
        raise ValueError(f"layout.tp = {tp}: no tensor-parallel plan for "
                         f"{type(model).__name__}; give the model a tp_plan() method "
                         "returning {fqn pattern: ParallelStyle}")
    head = getattr(model, "lm_head", None)
    embed = next((m for n, m in model.named_modules() if n.endswith("embed_tokens")), None)
    if head is not None and embed is not None and head.weight is embed.weight:
        raise ValueError(f"layout.tp = {tp}: 'lm_head' is tied to the input embedding, "
                         "which tensor parallelism splits on another dim; untie them")
    sizes = _split_sizes(model)
    undivided = sorted((s for s in sizes if s[2] % tp), key=lambda s: s[2])
    if undivided:  # the tightest first: under grouped-query attention the KV heads
        name, what, count = undivided[0]
        common = math.gcd(*(count for _, _, count in sizes))
        fitting = [d for d in range(1, common + 1) if common % d == 0]
        raise ValueError(f"layout.tp = {tp} does not divide the {count} {what} of "
                         f"'{name}'; the degrees that divide every split of this model: "
                         f"{', '.join(map(str, fitting))}")


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """The model's plan on the ``tp`` mesh (before ``dmuon.dedicate_params``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, tp_plan(model))
