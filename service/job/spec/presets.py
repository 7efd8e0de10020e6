"""Built-in model shapes: Llama-style dimensions and the named presets, without torch.

The job spec (torch-free) validates against them; ``service.job.models.builtin`` builds the modules.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    experts: int = 0  # per layer; 0: a dense MLP
    top_k: int = 2  # experts each token goes through
    moe_ffn_dim: int = 0  # an expert's hidden size; 0: ffn_dim

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.experts < 0 or self.moe_ffn_dim < 0:
            raise ValueError("experts and moe_ffn_dim must be >= 0")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must lie in [1, experts={self.experts}]")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim or self.ffn_dim


# The llama3-* shapes are taken from Meta's published Llama-3 model cards / config.json
# (Meta-Llama-3-8B and Meta-Llama-3-70B); only the numbers are reused, not any code.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=128, max_seq_len=64),
    "small": ModelConfig(vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=2,
                         ffn_dim=768, max_seq_len=256),
    # the built-in mixture of experts, small enough for a 2-CPU job
    "small-moe": ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                             ffn_dim=128, max_seq_len=256, experts=8, top_k=2,
                             moe_ffn_dim=128),
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


def num_params(config: str | ModelConfig) -> int:
    """Total parameter count computed from the config alone (no model is built)."""
    c = get_config(config)
    q_out, kv_out = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    if c.experts:  # the router, then each expert's gate, up and down projections
        mlp = c.dim * c.experts + 3 * c.experts * c.expert_ffn_dim * c.dim
    else:
        mlp = 3 * c.ffn_dim * c.dim
    per_layer = 2 * c.dim + 2 * q_out * c.dim + 2 * kv_out * c.dim + mlp
    head = 0 if c.tie_embeddings else c.vocab_size * c.dim
    return c.vocab_size * c.dim + c.n_layers * per_layer + c.dim + head
