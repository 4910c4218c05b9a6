"""Named layers to lay out: the weights one sharded layer gathers, as ``(name, shape, dtype)`` specs.

These feed :class:`~wsharding.core.layout.FlatLayout` in the notebooks and the layout panel. Real shapes
come from public model configs; where a model's config is not public (Kimi K3), the preset says how
its shapes were chosen so that nobody mistakes them for the real model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wsharding.core.layout import LayoutError
from wsharding.core.units import ceil_div

#: Block size of block-wise FP8 checkpoints (``weight_block_size: [128, 128]`` in the DeepSeek-V3 and
#: Kimi-K2 configs): one fp32 scale per 128 x 128 tile of the weight.
FP8_BLOCK = 128

Spec = tuple[str, tuple[int, ...], torch.dtype]


#: A small layer with weights of several dtypes whose sizes make chunks cross weight borders
#: (the first form of the demo gathered it; notebook 01 offers it as a preset).
DEMO_LAYER = [
    ("attn.qkv_proj", (96, 64), torch.bfloat16),
    ("attn.o_proj", (64, 64), torch.bfloat16),
    ("moe.router", (8, 64), torch.float32),
    ("moe.latent_down", (33, 64), torch.float8_e4m3fn),
    ("moe.latent_up", (64, 33), torch.float16),
    ("moe.shared_expert", (5, 7), torch.int8),
]


@dataclass(frozen=True)
class LayerPreset:
    """A named list of weight specs plus where its shapes come from."""

    title: str
    specs: tuple[Spec, ...]
    source: str


def llama31_8b_layer() -> list[Spec]:
    """One decoder layer of Llama-3.1-8B in bf16, with the checkpoint's parameter names.

    Shapes from the public ``meta-llama/Llama-3.1-8B`` config.json: hidden_size 4096,
    intermediate_size 14336, 32 attention heads and 8 key/value heads of head_dim 128
    (so k/v projections have 8 * 128 = 1024 rows). 7 weights, 416 MiB.
    """
    h, i, kv = 4096, 14336, 8 * 128
    bf16 = torch.bfloat16
    return [
        ("self_attn.q_proj.weight", (h, h), bf16),
        ("self_attn.k_proj.weight", (kv, h), bf16),
        ("self_attn.v_proj.weight", (kv, h), bf16),
        ("self_attn.o_proj.weight", (h, h), bf16),
        ("mlp.gate_proj.weight", (i, h), bf16),
        ("mlp.up_proj.weight", (i, h), bf16),
        ("mlp.down_proj.weight", (h, i), bf16),
    ]


def _fp8_with_scale(name: str, rows: int, cols: int) -> list[Spec]:
    # Block FP8: the fp8 weight plus one fp32 inverse scale per 128 x 128 tile (ceil on both axes).
    tiles = (ceil_div(rows, FP8_BLOCK), ceil_div(cols, FP8_BLOCK))
    return [(f"{name}.weight", (rows, cols), torch.float8_e4m3fn), (f"{name}.scale_inv", tiles, torch.float32)]


def k3_like_moe_peripherals(scale: int = 1) -> list[Spec]:
    """The MoE-peripheral weights of one Kimi-K3-like layer in block FP8, optionally shrunk.

    Where the shapes come from -- K3's config is not public, so these are *chosen*, not copied:

    * hidden size 7168 is Kimi K2's public ``hidden_size`` (``moonshotai/Kimi-K2-Instruct`` config);
    * the latent MoE width 3584 and the shared-expert intermediate size 6144 are our picks that make
      the four projections exactly 183.5 M parameters, i.e. 367.0 MB per layer in BF16 -- the
      "BF16 每层 367 MB" of SGLang's weight sharding for Kimi K3 (x 92 layers = 31.45 GiB, as there);
    * the names are short forms of the design's targets: ``expert_down`` / ``expert_up`` are the latent
      MoE's ``routed_expert_down_proj`` / ``routed_expert_up_proj``, ``shared_*`` the shared expert;
      ``scale_inv`` is the checkpoint's ``weight_scale_inv``.

    In FP8 each weight is one byte per element and travels with its fp32 block scales (a choice
    made for this picture: the design keeps ModelOpt per-tensor scales replicated, outside the layout).
    ``scale`` divides every dimension (a power of two up to 512) so a small copy can be gathered on
    CPU ranks; at ``scale=32`` the 2 x 3 scale tiles are 24 bytes and leave alignment holes.
    """
    if not isinstance(scale, int) or scale < 1 or 512 % scale:
        raise LayoutError(f"k3_like_moe_peripherals: scale must be a power of two from 1 to 512, got {scale!r}")
    h, latent, inter = 7168 // scale, 3584 // scale, 6144 // scale
    return [
        *_fp8_with_scale("expert_down", latent, h),
        *_fp8_with_scale("expert_up", h, latent),
        *_fp8_with_scale("shared_gate_up", 2 * inter, h),
        *_fp8_with_scale("shared_down", h, inter),
    ]


#: Presets offered by the layout panel, by key.
LAYOUT_PRESETS: dict[str, LayerPreset] = {
    "demo": LayerPreset(
        "demo layer (wsharding.lab.layout_presets.DEMO_LAYER, 6 mixed-dtype weights)",
        tuple(DEMO_LAYER),
        "wsharding.lab.layout_presets.DEMO_LAYER: small, odd sizes chosen so that chunks cross weight borders",
    ),
    "llama31_8b": LayerPreset(
        "Llama-3.1-8B decoder layer, bf16 (416 MiB)",
        tuple(llama31_8b_layer()),
        "meta-llama/Llama-3.1-8B config.json (hidden 4096, intermediate 14336, 8 kv heads x 128)",
    ),
    "k3_moe_fp8": LayerPreset(
        "Kimi-K3-like MoE peripherals, block FP8 + fp32 scales (175 MiB)",
        tuple(k3_like_moe_peripherals()),
        "hidden 7168 from Kimi K2's config; latent 3584 / shared 6144 chosen to match the weight-sharding "
        "design's 367 MB BF16",
    ),
    "k3_moe_fp8_small": LayerPreset(
        "Kimi-K3-like MoE peripherals, block FP8, 1/32 scale (gatherable on CPU ranks)",
        tuple(k3_like_moe_peripherals(32)),
        "the K3-like preset with every dimension divided by 32",
    ),
}


def preset_specs(key: str) -> list[Spec]:
    """The specs of preset ``key``; a clear error lists the known keys."""
    if key not in LAYOUT_PRESETS:
        raise LayoutError(f"unknown layer preset {key!r}; known presets: {sorted(LAYOUT_PRESETS)}")
    return list(LAYOUT_PRESETS[key].specs)
