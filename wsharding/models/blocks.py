"""A stack of Llama-shaped blocks written with plain ``nn.Linear``: the model of the FSDP2 baseline.

``llama8b-blocks`` is the model of the FSDP2 baseline in ``wsharding bench step``: 8 blocks of Llama-3.1-8B's
shapes (hidden 4096, 32 query heads and 8 KV heads of 128, gated MLP 14336), 436 MB of BF16 weights
per block. It is sharded the generic way, from the outside, with
:func:`wsharding.core.runner.shard_blocks` -- the path a user takes with a model that is not ours -- and
the same model goes to FSDP2's ``fully_shard`` in ``wsharding bench step``.

Each rank runs its own tokens through every block (DP attention: causal attention over the rank's
own sequence, no KV cache); the block's six projections are the targets (:data:`BLOCK_TARGETS`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wsharding.core.errors import InvalidArgument


@dataclass(frozen=True)
class BlocksConfig:
    layers: int = 8
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def with_(self, **kw: Any) -> BlocksConfig:
        return replace(self, **kw)

    def bytes_per_block(self) -> int:
        h, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return (h * q + 2 * h * kv + q * h + h * 2 * f + f * h) * self.torch_dtype.itemsize


BLOCK_PRESETS: dict[str, BlocksConfig] = {
    "llama8b-blocks": BlocksConfig(),
    "tiny-blocks": BlocksConfig(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96),
    # float32 layers of 100 MiB, 800 MiB in all: large enough on CPU ranks that a resident set is not
    # noise, small enough for two of them on a laptop
    "cpu-blocks": BlocksConfig(hidden=2048, heads=16, kv_heads=4, head_dim=128, intermediate=2560, dtype="float32"),
}

#: The projections of a block that weight sharding takes (all of them: under DP attention every
#: rank holds a full replica of each).
BLOCK_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, eps=1e-5)


class LlamaBlock(nn.Module):
    """Pre-norm attention (GQA, causal over the rank's own tokens) and a gated MLP."""

    def __init__(self, cfg: BlocksConfig) -> None:
        super().__init__()
        h, q, kv, dt = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.torch_dtype
        self.cfg = cfg
        self.attn_norm = RMSNorm(h, dt)
        self.q_proj = nn.Linear(h, q, bias=False, dtype=dt)
        self.k_proj = nn.Linear(h, kv, bias=False, dtype=dt)
        self.v_proj = nn.Linear(h, kv, bias=False, dtype=dt)
        self.o_proj = nn.Linear(q, h, bias=False, dtype=dt)
        self.mlp_norm = RMSNorm(h, dt)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate, bias=False, dtype=dt)
        self.down_proj = nn.Linear(cfg.intermediate, h, bias=False, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        a = self.attn_norm(x)
        # [1, heads, T, head_dim] with the KV heads repeated: the layout the fused (flash) attention
        # kernels take; 3-D inputs or enable_gqa send SDPA to its quadratic-memory math fallback.
        rep = cfg.heads // cfg.kv_heads
        q = self.q_proj(a).view(1, t, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(a).view(1, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2).repeat_interleave(rep, dim=1)
        v = self.v_proj(a).view(1, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2).repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(t, -1))
        gate, up = self.gate_up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class BlocksModel(nn.Module):
    """``layers`` Llama-shaped blocks in an ``nn.ModuleList`` named ``layers``; input: hidden states
    ``[tokens, hidden]`` (no embedding: the blocks are what is measured)."""

    def __init__(self, cfg: BlocksConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return x

    def inputs(self, tokens: int, seed: int, device: torch.device | str) -> torch.Tensor:
        """Hidden states for ``tokens`` tokens, the same for the same seed on every build."""
        g = torch.Generator(device=device).manual_seed(seed)
        return torch.randn(tokens, self.cfg.hidden, generator=g, device=device, dtype=self.cfg.torch_dtype)


def blocks_config(preset: str | BlocksConfig) -> BlocksConfig:
    if isinstance(preset, BlocksConfig):
        return preset
    if preset not in BLOCK_PRESETS:
        raise InvalidArgument(f"preset: unknown blocks preset {preset!r}; known: {sorted(BLOCK_PRESETS)}")
    return BLOCK_PRESETS[preset]


def build_blocks(preset: str | BlocksConfig, device: torch.device | str, seed: int = 0) -> BlocksModel:
    """A :class:`BlocksModel` with weights drawn on ``device`` from ``seed``: two builds with the same
    seed on the same device are equal bit for bit (the replica and the model to shard)."""
    cfg = blocks_config(preset)
    with torch.device("meta"):
        model = BlocksModel(cfg)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
    return model.eval()
