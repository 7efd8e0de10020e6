"""Tiny Hugging Face configs the tests write, and the single-process float64 reference
a distributed job must match: torch.optim.Muon (its own update rule, with a float64 NS)
on every 2-D matrix of the decoder layers and on every expert's (out, in) slice of the
fused 3-D expert weights, torch.optim.AdamW on the rest, torch's clip_grad_norm_, the
schedule written out here, the same batches."""

from __future__ import annotations

import math

import torch

import dmuon
from helpers.train import fp64_newton_schulz, per_expert_leaves, step_per_expert
from service.worker.batches import Batches

LLAMA = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "architectures": ["LlamaForCausalLM"],
         "model_type": "llama"}
QWEN3_MOE = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
             "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
             "num_experts_per_tok": 2, "max_position_embeddings": 64,
             "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
RECIPE = {"steps": 10, "batch_size": 2, "seq_len": 16, "global_batch_tokens": 256,
          "precision": "float64", "clip_grad_norm": 0.5,
          "schedule": {"warmup_steps": 2, "decay": "cosine", "min_lr_ratio": 0.1},
          "optimizer": {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3,
                        "adamw_weight_decay": 0.05},
          "data": {"val_every": 0}, "layout": {"replicate": 2, "shard": 2}, "seed": 7}


def is_muon(name: str, param) -> bool:
    """The issue's rule, written out: 2-D/3-D weights inside the decoder layers, except
    the MoE router (``mlp.gate``)."""
    return ".layers." in name and param.ndim in (2, 3) and not name.endswith("mlp.gate.weight")


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def hf_model(config: dict, seed: int):
    import transformers

    cls = getattr(transformers, config["architectures"][0])
    hf_config = cls.config_class(**config)
    hf_config._experts_implementation = "eager"
    hf_config.use_cache = False
    model = cls._from_config(hf_config, dtype=torch.float64)
    dmuon.init_weights(model, seed=seed, init_fn=model._init_weights)
    return model


def reference_run(config: dict, recipe: dict = RECIPE, world: int = 4) -> dict:
    import torch.optim._muon as tmuon

    model = hf_model(config, recipe["seed"])
    o, s = recipe["optimizer"], recipe["schedule"]
    matrices, slices, others = per_expert_leaves(model, is_muon)
    muon = torch.optim.Muon(matrices + [leaf for _, _, leaf in slices], lr=o["lr"],
                            weight_decay=o["weight_decay"])
    adamw = torch.optim.AdamW(others, lr=o["adamw_lr"], betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=o["adamw_weight_decay"])
    bases = [(g, g["lr"]) for opt in (muon, adamw) for g in opt.param_groups]
    batches = Batches({"kind": "builtin"}, "train", recipe["seq_len"], recipe["seed"], 0.05)
    per_rank = recipe["batch_size"]
    micros = recipe["global_batch_tokens"] // (per_rank * recipe["seq_len"] * world)
    saved, tmuon._zeropower_via_newtonschulz = tmuon._zeropower_via_newtonschulz, \
        fp64_newton_schulz
    try:
        for step in range(recipe["steps"]):
            rows = batches.rows(step, per_rank * world * micros, 0, 1)
            logits = model(input_ids=rows[:, :-1], use_cache=False).logits
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                              rows[:, 1:].reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), recipe["clip_grad_norm"])
            for group, base in bases:
                group["lr"] = base * lr_factor(step, recipe["steps"], s["warmup_steps"],
                                               s["min_lr_ratio"])
            step_per_expert((muon, adamw), slices)
            model.zero_grad()
    finally:
        tmuon._zeropower_via_newtonschulz = saved
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
