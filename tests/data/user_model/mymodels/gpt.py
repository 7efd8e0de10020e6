"""A user's model, shipped to the workers in a job's working_dir: a small GPT with its
own names (``transformer.h.N``), LayerNorm with biases, tied-free head, learned positions.
``build(**kwargs)`` is the factory a job spec names (``mymodels.gpt:build``)."""

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.c_attn(x).split(d, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(torch.nn.functional.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, context):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, dim), "wpe": nn.Embedding(context, dim),
            "h": nn.ModuleList(Block(dim, heads) for _ in range(layers)),
            "ln_f": nn.LayerNorm(dim)})
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        t = self.transformer
        x = t.wte(tokens) + t.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def build(vocab=256, dim=32, layers=2, heads=2, context=64):
    return GPT(vocab, dim, layers, heads, context)
