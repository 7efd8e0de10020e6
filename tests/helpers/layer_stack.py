"""The tests' small language models around a layer of their own: an embedding, a stack
of layers under ``layers`` (DMuon's default hook boundaries), a head."""

from __future__ import annotations

from torch import nn


class LayerStack(nn.Module):
    def __init__(self, layer_cls, layers: int, vocab: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(layer_cls() for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)
