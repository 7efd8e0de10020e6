"""Pipeline stages, one split per architecture, beside the TP plans (``tp_plans.py``).

``split_stages(model, stages)`` cuts the built-in model (dense or MoE) or a Hugging Face
decoder (Llama, Qwen2, Qwen3, Qwen3-MoE) into ``stages`` stage modules, on the meta
device or not: ``layout.pp`` of them, or ``layout.pp x v`` for an interleaved schedule,
rank ``p`` holding stages ``p, p + pp, ...``. Each stage holds the model's own modules
(no copy) under their FQNs (``model.layers.5`` stays ``model.layers.5``), so a stage's
state dict keys are the whole model's and a checkpoint loads on any degree: the
embedding on the first stage, the final norm and the head on the last, the decoder
layers cut into equal consecutive runs, or into the runs ``layers`` names (the stored
plan's split, ``PlanDocument.pipeline["stages"][i]["layers"]``: ``[lo, hi)`` each, so
the workers run the split the planner stored). Each stage runs its layers as the whole
model's forward does (rotary tables and the causal mask made again on each stage);
the first takes token ids, the others the hidden states, the last gives the logits.

Under tensor parallelism (``sequence_shards`` = the TP degree, the plan of
``tp_plans.py`` applied to the whole model first) the hidden states between blocks,
and so between stages, are this rank's shard of the sequence: a stage sends 1/T of
the activations, and takes the positions of its rotary tables and causal mask from
the whole sequence, ``sequence_shards`` times its input's.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

_HF_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def _kind(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in _HF_TYPES:
        return "hf"
    if type(model).__name__ == "LlamaForCausalLM" and hasattr(config, "n_kv_heads"):
        return "builtin"
    return None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_pp_degree(model: nn.Module, stages: int, pp: int | None = None) -> None:
    """Refuse ``stages`` (``pp``, or ``pp x v`` interleaved) that does not cut the
    decoder layers evenly, an architecture without a split, or an ``lm_head`` tied to
    the embedding (the first and last stages would each hold it)."""
    pp = stages if pp is None else pp
    if stages == 1:
        return
    if _kind(model) is None:
        raise ValueError(f"layout.pp = {pp}: no pipeline split for {type(model).__name__}; "
                         "the built-in model and HF Llama, Qwen2, Qwen3 and Qwen3-MoE have one")
    n = len(model.model.layers)
    if n % stages:
        what = f"{stages} stages ({pp} x {stages // pp})" if stages != pp else f"{stages} stages"
        raise ValueError(f"layout.pp = {pp}: {what} do not divide the {n} decoder layers of "
                         f"{type(model).__name__} evenly; the stage counts that do: "
                         f"{_divisors(n)}")
    head, embed = getattr(model, "lm_head", None), model.model.embed_tokens
    if head is not None and head.weight is embed.weight:
        raise ValueError(f"layout.pp = {pp}: 'lm_head' is tied to the input embedding, "
                         "which the first stage holds and the last would too; untie them")


def equal_runs(n: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` equal consecutive runs ``[lo, hi)`` of ``n`` layers."""
    per = n // stages
    return [(i * per, (i + 1) * per) for i in range(stages)]


def check_runs(runs: list, n: int) -> list[tuple[int, int]]:
    """``runs`` as ``(lo, hi)`` pairs, refused unless they cover ``0..n`` in order, each
    holding one layer at least."""
    runs = [(int(lo), int(hi)) for lo, hi in runs]
    ends = [0] + [hi for _, hi in runs]
    if [lo for lo, _ in runs] != ends[:-1] or ends[-1] != n \
            or any(hi <= lo for lo, hi in runs):
        raise ValueError(f"layout.pp: the stage split {runs} does not cover the {n} decoder "
                         "layers in order, one layer at least per stage")
    return runs


class _Stage(nn.Module):
    """Stage ``index`` of ``stages``: the model's modules under their FQNs, its layers
    ``run`` = ``[lo, hi)``."""

    def __init__(self, model: nn.Module, index: int, stages: int, run: tuple[int, int],
                 sequence_shards: int = 1):
        super().__init__()
        self.config, self.index, self.layer_range = model.config, index, tuple(run)
        self.first, self.last = index == 0, index == stages - 1
        self.sequence_shards = sequence_shards
        self.model = nn.Module()
        if self.first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict(
            {str(i): model.model.layers[i] for i in range(*run)})
        if self.last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        h = self.run_layers(h, h.shape[1] * self.sequence_shards)
        return self.lm_head(self.model.norm(h)) if self.last else h


class BuiltinStage(_Stage):
    """A stage of the built-in model: its layers take the rotary tables, under the
    model's activation checkpointing setting."""

    def __init__(self, model: nn.Module, index: int, stages: int, run: tuple[int, int],
                 sequence_shards: int = 1):
        super().__init__(model, index, stages, run, sequence_shards)
        self.activation_checkpointing = model.model.activation_checkpointing

    def run_layers(self, h: torch.Tensor, seq: int) -> torch.Tensor:
        from .builtin import rope_cos_sin, run_blocks

        c = self.config
        cos, sin = rope_cos_sin(torch.arange(seq, device=h.device), c.head_dim,
                                c.rope_theta, h.dtype)
        return run_blocks(self.model.layers.values(), h, cos, sin, self.activation_checkpointing)


class HFStage(_Stage):
    """A stage of a Hugging Face decoder: the rotary embedding (buffers alone) on every
    stage, the causal mask made as the model makes it."""

    def __init__(self, model: nn.Module, index: int, stages: int, run: tuple[int, int],
                 sequence_shards: int = 1):
        super().__init__(model, index, stages, run, sequence_shards)
        self.model.rotary_emb = model.model.rotary_emb

    def run_layers(self, h: torch.Tensor, seq: int) -> torch.Tensor:
        from transformers import masking_utils

        positions = torch.arange(seq, device=h.device).unsqueeze(0)
        make_mask = masking_utils.create_causal_mask \
            if getattr(self.config, "sliding_window", None) is None \
            else masking_utils.create_sliding_window_causal_mask
        whole = h[:, :1].expand(h.shape[0], seq, h.shape[2])  # the mask's shape: a view
        mask = make_mask(config=self.config, inputs_embeds=whole, attention_mask=None,
                         past_key_values=None, position_ids=positions)
        rotary = self.model.rotary_emb(h, position_ids=positions)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_ids=positions,
                      position_embeddings=rotary)
        return h


def split_stages(model: nn.Module, stages: int, pp: int | None = None,
                 layers: list | None = None, sequence_shards: int = 1) -> list[nn.Module]:
    """Every stage of ``model`` (``check_pp_degree`` first; ``pp``: the degree named in
    its messages when ``stages`` is ``pp x v``); ``layers``: each stage's ``[lo, hi)``
    (the stored plan's split), else equal runs; ``sequence_shards``: the TP degree of a
    model whose plan is applied."""
    check_pp_degree(model, stages, pp)
    if _kind(model) is None:
        raise ValueError(f"no pipeline split for {type(model).__name__}")
    n = len(model.model.layers)
    runs = equal_runs(n, stages) if layers is None else check_runs(layers, n)
    if len(runs) != stages:
        raise ValueError(f"layout.pp: {len(runs)} stage runs for {stages} stages")
    cls = BuiltinStage if _kind(model) == "builtin" else HFStage
    return [cls(model, i, stages, runs[i], sequence_shards) for i in range(stages)]
