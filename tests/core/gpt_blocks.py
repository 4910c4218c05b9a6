"""A small GPT-style model written for the tests: blocks in an nn.ModuleList, nn.Linear targets.

It knows nothing of wsharding: the generic path must shard it from the outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d, dtype=dtype)
        self.q_proj = nn.Linear(d, d, bias=True, dtype=dtype)
        self.k_proj = nn.Linear(d, d, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(d, d, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(d, d, bias=True, dtype=dtype)
        self.ln2 = nn.LayerNorm(d, dtype=dtype)
        self.fc1 = nn.Linear(d, ff, bias=True, dtype=dtype)
        self.fc2 = nn.Linear(ff, d, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o_proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=97, d=48, heads=4, ff=96, layers=4, dtype=torch.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, dtype=dtype)
        self.blocks = nn.ModuleList(Block(d, heads, ff, dtype) for _ in range(layers))
        self.norm = nn.LayerNorm(d, dtype=dtype)
        self.head = nn.Linear(d, vocab, bias=False, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))
