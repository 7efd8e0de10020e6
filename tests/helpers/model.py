"""The core tests' own model: a small Llama-style causal LM in plain torch.

The same architecture, parameter FQNs (``model.layers.{i}.self_attn.q_proj.weight``, ...),
shapes, presets and initialisation as the service's built-in model
(``service/job/models/builtin.py``), restated here so that the core's tests import nothing from
``service/``: their exact byte counts and FQN strings are computed from this model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import dmuon


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} not divisible by n_kv_heads={self.n_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=128, max_seq_len=64),
    "small": ModelConfig(vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
                         ffn_dim=768, max_seq_len=256),
    "llama3-8b": ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             ffn_dim=14336, max_seq_len=8192),
    "llama3-70b": ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              ffn_dim=28672, max_seq_len=8192),
}


def get_config(name_or_config: str | ModelConfig) -> ModelConfig:
    if isinstance(name_or_config, ModelConfig):
        return name_or_config
    try:
        return PRESETS[name_or_config]
    except KeyError:
        valid = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown model {name_or_config!r}; valid names: {valid}") from None


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
    """cos/sin tables [T, head_dim] for integer positions, computed on the fly."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim)
    angles = positions.to(work)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # x: [B, H, T, hd]; rotate-half convention
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
        # head counts from the projections' outputs: per-rank shards under colwise TP
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        _report_max_logits(self, q, k)  # a no-op unless dmuon.Muon(qk_clip=...) wants them
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _report_max_logits(attention: nn.Module, q: torch.Tensor, k: torch.Tensor) -> None:
    """Per-head max of the logits softmax sees (q . k / sqrt(head_dim), after RoPE, causal),
    folded into the step's running max that ``dmuon.Muon(qk_clip=...)`` reads."""
    dmuon.qk_clip.record_max_logits(attention, q, k)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down_proj = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = MLP(c)

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
        cos, sin = rope_cos_sin(torch.arange(t, device=tokens.device), c.head_dim,
                                c.rope_theta, h.dtype)
        for layer in self.layers:
            if self.activation_checkpointing:
                h = torch.utils.checkpoint.checkpoint(
                    layer, h, cos, sin,
                    use_reentrant=self.activation_checkpointing == "reentrant")
            else:
                h = layer(h, cos, sin)
        return self.norm(h)


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
    """Mean cross-entropy over all positions; targets are already shifted, shape [B, T]."""
    work = torch.promote_types(logits.dtype, torch.float32)  # float64 stays float64
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(work), targets.reshape(-1))


def muon_predicate(name: str, param: torch.Tensor) -> bool:
    """True for the 2-D projection matrices inside decoder layers (Muon); False otherwise."""
    return "model.layers." in name and param.ndim == 2


def init_builtin(module: nn.Module) -> None:
    """One module's own params: normal(0, 0.02) for matrices and embeddings, ones for norms."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    elif isinstance(module, RMSNorm):
        module.reset_parameters()


def build_model(config: str | ModelConfig, *, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, seed: int | None = None) -> LlamaForCausalLM:
    """Built on meta; on the meta device left uninitialised (``dmuon.materialize`` does it
    later, by the same rule), otherwise each module initialised by ``init_builtin`` under
    its own seed from ``seed`` and its FQN (``dmuon.init_weights``). ``seed=None`` draws
    one from torch's global RNG."""
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


class OneMatrix(nn.Module):
    """One 16 x 16 matrix as ``layers.0``: the smallest model with a hook boundary."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16, bias=False)])

    def forward(self, x):
        return self.layers[0](x)


def dedicated_fp16_matrix(world: int) -> OneMatrix:
    """``OneMatrix`` dedicated over ``world`` ranks with fp16 params and fp16 reduces."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import dmuon

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = OneMatrix()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2, mp_policy=policy)
    return model
