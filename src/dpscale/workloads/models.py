"""Benchmark models by name: the engine benchmark's MLP and a small decoder-only transformer.

Both are sized so one CPU core does a step in tens of milliseconds and the gradient volume is
large enough (MLP: 6.3 M parameters, 25 MB of fp32 gradients) that communication matters.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def mlp(width: int = 1024, depth: int = 6, in_features: int = 1024, classes: int = 10) -> nn.Module:
    """`depth` x (Linear(width, width) + ReLU), then a Linear(width, classes) head."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(in_features if i == 0 else width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class TinyDecoder(nn.Module):
    """A pre-norm causal transformer over byte tokens; returns logits of shape (B, T, vocab)."""

    causal_mask: torch.Tensor  # a buffer (register_buffer below)

    def __init__(
        self, vocab: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, seq_len: int = 64
    ):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        nn.init.normal_(self.pos, std=1.0 / math.sqrt(d_model))
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def transformer(seq_len: int = 64) -> nn.Module:
    return TinyDecoder(seq_len=seq_len)


class DigitsNet(nn.Module):
    """A small MLP for 8x8 digit images (64 features, 10 classes)."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
