"""A small Llama-style causal language model (pure torch) used by the service and benchmarks.

Parameter names follow the familiar ``model.layers.{i}.self_attn.q_proj.weight`` layout so that
Muon/AdamW split (``service.job.models.params``) and checkpoints are easy to reason about.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from ..spec.presets import PRESETS, ModelConfig, get_config, num_params  # noqa: F401


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [T, head_dim] for integer positions, computed on the fly (no buffers)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim
    )
    angles = positions.to(work)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, hd]; rotate-half convention.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    # QK-clip (dmuon.qk_clip): the projections whose head rows it scales
    qk_clip_weights = ("q_proj.weight", "k_proj.weight")

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.head_dim = c.head_dim
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # head counts come from the projections' outputs, which are per-rank shards under
        # tensor parallelism (colwise q/k/v)
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = _attention(self, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _attention(attention: nn.Module, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over GQA heads; where ``dmuon.Muon(qk_clip=...)`` tracks the module,
    ``dmuon.qk_clip.attention``, which also records each head's max logit (q . k /
    sqrt(head_dim), after RoPE) from the attention kernel itself on CUDA."""
    import dmuon  # imported by whoever dedicated the model: a lookup, not a load

    if dmuon.qk_clip.is_tracking(attention):
        return dmuon.qk_clip.attention(attention, q, k, v)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down_proj = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """The MoE layer's experts as 3-D weights, one ``(out, in)`` matrix per expert (one
    checkpoint key per whole tensor); called as Hugging Face calls its experts, so that
    ``service.job.models.experts`` dispatches both the same way."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.num_experts = c.experts
        f = c.expert_ffn_dim
        self.gate_proj = nn.Parameter(torch.empty(c.experts, f, c.dim))
        self.up_proj = nn.Parameter(torch.empty(c.experts, f, c.dim))
        self.down_proj = nn.Parameter(torch.empty(c.experts, c.dim, f))

    def grouped(self, rows: torch.Tensor, groups) -> torch.Tensor:
        """This rank's experts on ``rows`` grouped by local expert (``groups``: a
        ``dmuon.RowGroups``), each layer one grouped product of the whole 3-D weight: a
        select per expert would make the backward write E copies of it."""
        import dmuon

        h = F.silu(dmuon.grouped_linear(rows, self.gate_proj, groups)) * \
            dmuon.grouped_linear(rows, self.up_proj, groups)
        return dmuon.grouped_linear(h, self.down_proj, groups)

    def forward(self, x: torch.Tensor, choices: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """``[n, dim]``: each token's ``top_k`` experts' outputs weighted by ``weights``
        (routed as under EP, without the exchanges: one sort, one host sync)."""
        import dmuon

        return dmuon.dispatch_combine(x, choices, weights, self.grouped, self.num_experts,
                                      None)


class MoE(nn.Module):
    """A mixture of experts in place of the MLP: a softmax router (``gate``, AdamW by the
    param rule) picks each token's ``top_k`` experts, their weights renormalised over
    the k."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.top_k = c.top_k
        self.gate = nn.Linear(c.dim, c.experts, bias=False)
        self.experts = Experts(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, choices = self.gate(h).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(h, choices, weights).view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = MoE(c) if c.experts else MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        # per-block activation checkpointing: None, "reentrant" or "non_reentrant"
        self.activation_checkpointing: str | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        c = self.config
        t = tokens.shape[1]
        if t > c.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {c.max_seq_len}")
        h = self.embed_tokens(tokens)
        positions = torch.arange(t, device=tokens.device)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype)
        return self.norm(run_blocks(self.layers, h, cos, sin, self.activation_checkpointing))


def run_blocks(layers, h: torch.Tensor, cos, sin, activation_checkpointing) -> torch.Tensor:
    """The decoder blocks in order, each checkpointed when ``activation_checkpointing``
    says so (the whole model's forward and a pipeline stage's run the same loop)."""
    for layer in layers:
        if activation_checkpointing:
            h = torch.utils.checkpoint.checkpoint(
                layer, h, cos, sin, use_reentrant=activation_checkpointing == "reentrant")
        else:
            h = layer(h, cos, sin)
    return h


class LlamaForCausalLM(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.config = c
        self.model = LlamaModel(c)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: LongTensor [B, T] -> logits [B, T, vocab]."""
        return self.lm_head(self.model(tokens))


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all positions; targets are already shifted, shape [B, T].
    Logits sharded on the vocabulary (a TP head's DTensor) stay sharded: call it, and
    the backward, under ``loss_parallel()`` (``vocab_parallel``); the loss comes back
    as this rank's tensor."""
    # Low-precision logits are upcast for a stable softmax; float64 stays float64.
    work = torch.promote_types(logits.dtype, torch.float32)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(work), targets.reshape(-1))
    return loss.to_local() if hasattr(loss, "to_local") else loss


def vocab_parallel(tp: int):
    """The context a TP job's loss and its backward run in: logits sharded on the
    vocabulary are reduced across the TP group inside the cross-entropy (torch's
    ``loss_parallel``) rather than gathered whole on every rank."""
    if tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def init_builtin(module: nn.Module) -> None:
    """The built-in models' initialisation of one module's own params: normal(0, 0.02)
    for matrices, experts and embeddings, ones for norms."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, Experts):
        for p in (module.gate_proj, module.up_proj, module.down_proj):
            nn.init.normal_(p, 0.0, 0.02)
    elif isinstance(module, RMSNorm):
        module.reset_parameters()


def build_model(
    config: str | ModelConfig,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> LlamaForCausalLM:
    """Build the model. On the meta device nothing is initialised (``dmuon.materialize``
    does it later, by the same rule); otherwise every module is initialised by
    ``init_builtin`` under a seed of its own derived from ``seed`` and its FQN
    (``dmuon.init_weights``), so the values do not depend on how the model is later
    laid out. ``seed=None`` draws a seed from torch's global RNG."""
    import dmuon

    c = get_config(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(c)
    if dtype is not None:
        model = model.to(dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "meta":
        return model
    model = model.to_empty(device=device)
    if c.tie_embeddings:  # to_empty materializes each module separately: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    if seed is None:
        seed = int(torch.randint(0, 2**62, ()).item())
    dmuon.init_weights(model, seed=seed, init_fn=init_builtin)
    return model
