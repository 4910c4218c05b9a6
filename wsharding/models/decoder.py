"""A small decoder shaped like the deployment of SGLang's weight sharding for Kimi K3: decode, DP attention + MoE.

* Layer 0 is dense (attention + gated MLP) and, as in the design's default range, is not sharded.
* Layers 1.. have **DP attention**: every rank runs its own tokens through a full attention copy, so
  q/k/v/o are replicated linears (``parallel_group="replicated"``, GQA with fewer KV heads).
* and a **latent MoE** whose peripherals are replicated too: a router, latent down/up projections
  around a few local routed experts (experts would be EP-sharded in a deployment; here every rank
  holds the few it uses), and a shared expert built with tp 1.

The weights weight sharding takes are exactly the design's targets: ``attn.qkv_proj``, ``attn.o_proj``,
``moe.latent_down``, ``moe.latent_up``, ``moe.shared_expert.gate_up_proj``,
``moe.shared_expert.down_proj`` -- one flat layout, one gather per layer. The router and the routed
experts stay replicated.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wsharding.core.comm import Communicator
from wsharding.core.errors import InvalidArgument
from wsharding.core.runner import prepare_layer_weight_shard_forward, run_layers
from wsharding.core.sharding import WeightSharding
from wsharding.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    process_weights,
)
from wsharding.linear.methods import make_quant_method
from wsharding.models.kv_cache import KVStep
from wsharding.models.serve_step import AttnGroup, ServeStep


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    dense_inter: int
    latent: int
    experts: int
    top_k: int
    expert_inter: int
    shared_inter: int
    dtype: str = "bfloat16"
    #: Parallel group of the attention projections: ``"replicated"`` (DP attention, built unsplit) or
    #: ``"attn_tp"`` (split over attention-TP, which is of size 1 under full DP attention).
    attn_group: str = "replicated"
    #: Parallel group of the shared expert: ``"replicated"`` (tp 1, as the design's) or ``"shared_experts_tp"``
    #: (TP MoE: split, and run over the tokens of every rank of the group).
    moe_group: str = "replicated"
    #: Merge ``latent_down`` and the shared expert's ``gate_up_proj`` into one GEMM (the design's
    #: ``_merge_front_weights``) where neither is sharded: a fusion that changes storage.
    merge_front: bool = False
    #: quant method of the sharding targets (and layer 0's projections): a name of
    #: :data:`wsharding.linear.methods.METHODS` -- "none", "int8", "fp8" (ModelOpt per-tensor), "fp8_block"
    quant: str = "none"
    #: block edge of the block-scaled methods ("fp8_block", "int8_block"): blocks are quant_block x quant_block
    quant_block: int = 128

    def quant_method(self):
        """A fresh quant method for one linear (None: unquantized)."""
        block = (self.quant_block, self.quant_block)
        return make_quant_method(self.quant, **({"block": block} if self.quant.endswith("_block") else {}))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def with_(self, **kw: Any) -> DecoderConfig:
        return replace(self, **kw)

    def sharded_bytes_per_layer(self) -> int:
        """Bytes of one MoE layer's sharding targets (before layout padding), with the default groups
        (every target tp 1)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        params = (q + 2 * kv) * h + h * q + self.latent * h + h * self.latent + 2 * self.shared_inter * h + h * self.shared_inter
        return params * self.torch_dtype.itemsize

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, DecoderConfig] = {
    # CI: dimensions divisible by 1, 2, 3 and 4 so every group size shards every target.
    "tiny": DecoderConfig(vocab=192, hidden=96, layers=4, heads=4, kv_heads=2, head_dim=24, dense_inter=192,
                          latent=48, experts=4, top_k=2, expert_inter=48, shared_inter=48),
    # The CPU demo's default: tiny layers, but enough of them that the two slots are paid back.
    "tiny-deep": DecoderConfig(vocab=192, hidden=96, layers=12, heads=4, kv_heads=2, head_dim=24, dense_inter=192,
                               latent=48, experts=4, top_k=2, expert_inter=48, shared_inter=48),
    "small": DecoderConfig(vocab=2048, hidden=768, layers=6, heads=12, kv_heads=4, head_dim=64, dense_inter=1536,
                           latent=384, experts=4, top_k=2, expert_inter=384, shared_inter=768),
    # For GPUs: sharded bytes per layer close to the design's 367 MB of BF16 MoE peripherals per layer
    # (7168 hidden as in K3-class models; 56 x 128 query heads, 8 KV heads; 370.7 MB per layer).
    "k3-like": DecoderConfig(vocab=32768, hidden=7168, layers=12, heads=56, kv_heads=8, head_dim=128,
                             dense_inter=14336, latent=2048, experts=8, top_k=2, expert_inter=1024,
                             shared_inter=1792),
}

SHARD_TARGETS = [
    "attn.qkv_proj", "attn.o_proj", "moe.latent_down", "moe.latent_up",
    "moe.shared_expert.gate_up_proj", "moe.shared_expert.down_proj",
]


def qkv_gemm_plan(qkv: QKVParallelLinear) -> dict[str, Any]:
    """The qkv projection's GEMM, decided from the full shape of its weight: one merged GEMM over this
    rank's ``[q; k; v]`` rows, then a split into ``[q, k, v]`` columns.

    A decision that needs the full shape (the weight-sharding design's kernel choices in ``__init__``): weight
    sharding later shrinks the weight to 1/N rows, so it must be taken before; asked after the shrink
    it raises instead of planning for the wrong shape.
    """
    rows, cols = qkv.weight.shape
    if rows != qkv.output_size_per_partition:
        raise InvalidArgument(
            f"{qkv.prefix or 'qkv_proj'}.weight has {rows} rows, its partition has {qkv.output_size_per_partition}: "
            "weight sharding already shrank it. Fusion and kernel decisions need the full shape: take them before "
            "the shrink (in the layer's __init__, before WeightSharding.setup_layer)"
        )
    return {"gemm": "merged", "rows": rows, "cols": cols, "split": [qkv.q_size, qkv.kv_size, qkv.kv_size]}


class Attention(nn.Module):
    """Causal GQA self-attention over this rank's own tokens.

    ``cfg.attn_group`` ``"replicated"`` (DP attention: nothing is split) or ``"attn_tp"`` (each rank holds
    its heads; size 1 under full DP attention, where it is the same as replicated).
    """

    def __init__(self, cfg: DecoderConfig, prefix: str) -> None:
        super().__init__()
        dt = cfg.torch_dtype
        self.qkv_proj = QKVParallelLinear(cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, bias=False,
                                          params_dtype=dt, parallel_group=cfg.attn_group, prefix=f"{prefix}.qkv_proj",
                                          quant_method=cfg.quant_method())
        self.o_proj = RowParallelLinear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False, params_dtype=dt,
                                        parallel_group=cfg.attn_group, prefix=f"{prefix}.o_proj",
                                        quant_method=cfg.quant_method())
        self.heads, self.kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim
        #: Decided now, from the full shape (see :func:`qkv_gemm_plan`).
        self.qkv_gemm = qkv_gemm_plan(self.qkv_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_gemm["split"], dim=-1)
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(0, 1).reshape(t, self.heads * self.head_dim))

    def forward_cached(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: KVStep) -> torch.Tensor:
        """The decode path: ``x`` holds ``step.new`` tokens of each of ``step.count`` sequences (``[B*T, hidden]``);
        their K/V are written into the cache views ``[B, kv_heads, start+T, head_dim]``, then every query
        attends to its sequence's cached tokens up to itself.

        GQA without copying the cache: the query heads of one KV head are stacked as extra query rows
        (``[B, kv_heads, rep*T, head_dim]``), so attention reads the cache as it lies.
        """
        b, t, rep = step.count, step.new, self.heads // self.kv_heads
        q, k, v = self.qkv_proj(x).split(self.qkv_gemm["split"], dim=-1)
        k_cache[:, :, step.start :] = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v_cache[:, :, step.start :] = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        # head h uses KV head h // rep (as repeat_interleave in forward): group the rep heads of a KV head
        q = q.view(b, t, self.kv_heads, rep, self.head_dim).permute(0, 2, 3, 1, 4).reshape(b, self.kv_heads, rep * t, -1)
        mask = None
        if t > 1:  # a prompt: query i sees the cached prefix and the new tokens up to itself
            seen = torch.arange(step.start + t, device=x.device)[None, :] <= step.start + torch.arange(t, device=x.device)[:, None]
            mask = seen.repeat(rep, 1)
        a = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        a = a.view(b, self.kv_heads, rep, t, self.head_dim).permute(0, 3, 1, 2, 4).reshape(b * t, -1)
        return self.o_proj(a)

    def forward_serve(self, x: torch.Tensor, layer_id: int, step: ServeStep) -> torch.Tensor:
        """The serving path: ``x`` holds the step's rows (``[rows, hidden]``), each a token of its own
        sequence at its own position. Their K/V are written into the step's token rows first, so that a
        prompt's rows see each other; then each group of the step (sequences of one context bucket,
        :class:`~wsharding.models.serve_step.AttnGroup`) runs one attention: an entry's context is
        gathered once, at its group's width, and its query slots -- one for a decode, a chunk's rows
        for a prefill chunk -- attend over it. The shapes are the step's (:attr:`ServeStep.shape
        <wsharding.models.serve_step.ServeStep.shape>`), bucketed, not fixed."""
        rows, rep, hd = x.shape[0], self.heads // self.kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split(self.qkv_gemm["split"], dim=-1)
        step.store(layer_id, k.view(rows, self.kv_heads, hd), v.view(rows, self.kv_heads, hd))
        q = q.reshape(rows, self.kv_heads, rep, hd)  # the rep query heads of a KV head as query rows
        parts = [self._group_attention(q, step, layer_id, g) for g in step.groups]
        a = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.o_proj(a[step.out_index])

    def _group_attention(self, q: torch.Tensor, step: ServeStep, layer_id: int, group: AttnGroup) -> torch.Tensor:
        """One group's attention: ``[entries * length, heads * head_dim]``, entry-major."""
        rep, hd = self.heads // self.kv_heads, self.head_dim
        entries, length = group.entries, group.length
        k_seen, v_seen = step.gathered(layer_id, group)  # [entries, kv_heads, width, head_dim]
        # an entry's queries: its slots x the rep heads of a KV head, slot-major, so a row's heads sit together
        qg = q[group.rows].permute(0, 2, 1, 3, 4).reshape(entries, self.kv_heads, length * rep, hd)
        if length == 1:  # decode entries: one mask row serves the rep heads
            mask = group.mask[:, None]  # [entries, 1, 1, width]
        else:
            mask = group.mask.repeat_interleave(rep, dim=1)[:, None]  # [entries, 1, length * rep, width]
        a = F.scaled_dot_product_attention(qg, k_seen, v_seen, attn_mask=mask)
        a = a.view(entries, self.kv_heads, length, rep, hd).permute(0, 2, 1, 3, 4)
        return a.reshape(entries * length, self.heads * hd)


def over_group_tokens(fn: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
    """Run a tensor-parallel block on the tokens of every rank of ``group`` and return this rank's rows.

    Under DP attention each rank holds its own tokens, while a TP block needs the same tokens on every
    member: gather them (padded to the longest rank), compute, keep this rank's rows. Every rank calls it
    (idle ranks with their one-token dummy step), so the collectives pair up.
    """
    count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    longest = int(group.all_gather(count, dim=0).max())
    padded = torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])]) if longest > x.shape[0] else x
    out = fn(group.all_gather(padded.contiguous(), dim=0))
    start = group.rank_in_group * longest
    return out[start : start + x.shape[0]]


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate/up merged in one linear, on ``group`` (default tp 1;
    ``"shared_experts_tp"``: split, run over the group's tokens by :func:`over_group_tokens`)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, prefix: str, group: str = "replicated",
                 cfg: DecoderConfig | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, params_dtype=dtype,
                                                       parallel_group=group, prefix=f"{prefix}.gate_up_proj",
                                                       quant_method=cfg.quant_method() if cfg else None)
        self.down_proj = RowParallelLinear(inter, hidden, bias=False, params_dtype=dtype,
                                           parallel_group=group, prefix=f"{prefix}.down_proj",
                                           quant_method=cfg.quant_method() if cfg else None)
        #: This rank's gate and up widths.
        self.parts = list(self.gate_up_proj.output_partition_sizes)

    def from_gate_up(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The rest of the block, from the output of ``gate_up_proj`` (or of a merged GEMM that holds it)."""
        gate, up = gate_up.split(self.parts, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.tp_size > 1:
            return over_group_tokens(lambda h: self.from_gate_up(self.gate_up_proj(h)), x, self.gate_up_proj.tp_group)
        return self.from_gate_up(self.gate_up_proj(x))


class Expert(nn.Module):
    """A routed expert working in the latent space (replicated here; EP-sharded in a deployment)."""

    def __init__(self, latent: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w1 = nn.Linear(latent, inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, latent, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class LatentMoE(nn.Module):
    """Router + latent down -> top-k routed experts -> latent up, plus a shared expert (tp 1, or TP MoE
    with ``cfg.moe_group``)."""

    def __init__(self, cfg: DecoderConfig, prefix: str) -> None:
        super().__init__()
        dt = cfg.torch_dtype
        self.top_k = cfg.top_k
        self.router = ReplicatedLinear(cfg.hidden, cfg.experts, bias=False, params_dtype=torch.float32,
                                       prefix=f"{prefix}.router")
        self.latent_down = ReplicatedLinear(cfg.hidden, cfg.latent, bias=False, params_dtype=dt,
                                            prefix=f"{prefix}.latent_down", quant_method=cfg.quant_method())
        self.experts = nn.ModuleList(Expert(cfg.latent, cfg.expert_inter, dt) for _ in range(cfg.experts))
        self.latent_up = ReplicatedLinear(cfg.latent, cfg.hidden, bias=False, params_dtype=dt,
                                          prefix=f"{prefix}.latent_up", quant_method=cfg.quant_method())
        self.shared_expert = GatedMLP(cfg.hidden, cfg.shared_inter, dt, f"{prefix}.shared_expert", cfg.moe_group, cfg)
        #: ``latent_down`` and ``shared_expert.gate_up_proj`` stacked, when :meth:`plan_front_merge` merged them.
        self.front_weight: torch.Tensor | None = None

    def plan_front_merge(self, enabled: bool, sharded: Collection[str]) -> str:
        """Decide the front merge (one GEMM for ``latent_down`` and the shared expert's ``gate_up_proj``,
        which read the same input). It changes storage, so a weight that weight sharding takes must not
        join it (the design skips ``_merge_front_weights`` when the MoE is sharded): the merged copy would
        hold that weight in full on every rank. ``sharded``: names (inside this module) of the targets.
        Decided with the full shapes, before the shrink."""
        self.front_weight = None
        if not enabled:
            return "off"
        names = ("latent_down", "shared_expert.gate_up_proj")
        taken = [n for n in names if n in sharded]
        if taken:
            return f"skipped: {', '.join(taken)} sharded (weights become slot views; a merged copy would keep them whole)"
        gate_up = self.shared_expert.gate_up_proj
        if gate_up.tp_size != 1:
            return f"skipped: the shared expert is split (tp size {gate_up.tp_size}), latent_down is not"
        for lin in (self.latent_down, gate_up):
            if lin.weight.shape[0] != lin.output_size_per_partition:
                raise InvalidArgument(f"{lin.prefix}.weight has {lin.weight.shape[0]} rows, its partition has "
                                 f"{lin.output_size_per_partition}: decide the front merge before weight sharding "
                                 "shrinks the layer")
        self.front_weight = torch.cat([self.latent_down.weight.detach(), gate_up.weight.detach()])
        return f"merged: one GEMM of {list(self.front_weight.shape)}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x.float()), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # Dense gating (every expert sees every token, weighted 0 when not chosen): no data-dependent
        # shapes, so the step can be captured in a CUDA graph. Fine for the few experts of this model.
        gate = torch.zeros_like(probs).scatter_(1, chosen, weights).to(x.dtype)
        if self.front_weight is not None:
            h, gate_up = F.linear(x, self.front_weight).split([self.latent_down.output_size, sum(self.shared_expert.parts)],
                                                               dim=-1)
            shared = self.shared_expert.from_gate_up(gate_up)
        else:
            h = self.latent_down(x)
            shared = self.shared_expert(x)
        routed = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            routed = routed + expert(h) * gate[:, e : e + 1]
        return self.latent_up(routed) + shared


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        dt = cfg.torch_dtype
        p = f"layers.{layer_id}"
        self.attn_norm = nn.RMSNorm(cfg.hidden, dtype=dt)
        self.attn = Attention(cfg, f"{p}.attn")
        self.mlp_norm = nn.RMSNorm(cfg.hidden, dtype=dt)
        self.dense = layer_id == 0
        if self.dense:
            self.mlp = GatedMLP(cfg.hidden, cfg.dense_inter, dt, f"{p}.mlp", cfg=cfg)
            self.weight_shard_targets = ["attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
        else:
            self.moe = LatentMoE(cfg, f"{p}.moe")
            self.weight_shard_targets = list(SHARD_TARGETS)

    def plan_fusions(self, sharded: Collection[str] = ()) -> dict[str, str]:
        """Fusion decisions that need the full shapes and the list of sharding targets (``sharded``:
        attribute paths inside this layer): taken after :meth:`WeightSharding.declare` and before
        :meth:`WeightSharding.setup_layer` shrinks the targets, as the design takes its kernel choices and
        skips its storage-changing fusions at the end of the layer's ``__init__``."""
        plan = self.attn.qkv_gemm
        self.fusions = {"qkv_gemm": f"{plan['gemm']}: one GEMM of [{plan['rows']}, {plan['cols']}], split {plan['split']}"}
        if not self.dense:
            inner = {n.removeprefix("moe.") for n in sharded if n.startswith("moe.")}
            self.fusions["front_merge"] = self.moe.plan_front_merge(self.cfg.merge_front, inner)
        return self.fusions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prepare_layer_weight_shard_forward(self)  # waits (once) for this layer's gathered weights
        x = x + self.attn(self.attn_norm(x))
        ffn = self.mlp if self.dense else self.moe
        return x + ffn(self.mlp_norm(x))

    def forward_cached(self, x: torch.Tensor, step: KVStep) -> torch.Tensor:
        """:meth:`forward` on the decode path, attention reading and writing ``step``'s KV-cache slots."""
        prepare_layer_weight_shard_forward(self)
        k_cache, v_cache = step.pool.layer(self.layer_id, step.first, step.count, step.start + step.new)
        x = x + self.attn.forward_cached(self.attn_norm(x), k_cache, v_cache, step)
        ffn = self.mlp if self.dense else self.moe
        return x + ffn(self.mlp_norm(x))

    def forward_serve(self, x: torch.Tensor, step: ServeStep) -> torch.Tensor:
        """:meth:`forward` on the serving path (a :class:`~wsharding.models.serve_step.ServeStep`)."""
        prepare_layer_weight_shard_forward(self)
        x = x + self.attn.forward_serve(self.attn_norm(x), self.layer_id, step)
        ffn = self.mlp if self.dense else self.moe
        return x + ffn(self.mlp_norm(x))


class ToyDecoder(nn.Module):
    """Embedding, layers (dense layer 0, DP-attention + latent-MoE layers), norm, LM head.

    ``forward(tokens)`` takes one rank's token ids ``[T]`` and returns logits ``[T, vocab]``.
    With ``weight_sharding`` (a :class:`~wsharding.core.sharding.WeightSharding` not yet finalized) each
    layer's targets are shrunk to this rank's rows right after the layer is built, as the design's
    layers do at the end of ``__init__``: at most one layer's full weights exist during construction.
    """

    def __init__(self, cfg: DecoderConfig, *, seed: int = 0, weight_sharding: WeightSharding | None = None,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        dt = cfg.torch_dtype
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dt, device=device)
        _init_(self.embed, gen, device)
        self.layers = nn.ModuleList()
        for i in range(cfg.layers):
            layer = DecoderLayer(cfg, i).to(device)
            _init_(layer, gen, device)  # deterministic weights: the same on every rank for a seed
            self.layers.append(layer)
            # Decide, with the full shapes: the targets (from their groups), then the fusions, then shrink.
            chosen = weight_sharding.declare(i, layer) if weight_sharding is not None else []
            layer.plan_fusions({t.name for t in chosen})
            if weight_sharding is not None:
                weight_sharding.setup_layer(i)
        self.norm = nn.RMSNorm(cfg.hidden, dtype=dt, device=device)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dt, device=device)
        _init_(self.lm_head, gen, device)
        self.weight_sharding = weight_sharding

    @property
    def planner(self):
        ws = self.weight_sharding
        return None if ws is None else ws.planner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = run_layers(self.layers, h, self.planner)
        return self.lm_head(self.norm(h))

    def forward_cached(self, tokens: torch.Tensor, step: KVStep) -> torch.Tensor:
        """The decode path: ``tokens`` ``[B, T]`` -- ``T`` new tokens of each of the ``B`` sequences in slots
        ``[step.first, step.first + B)`` of a :class:`~wsharding.models.kv_cache.KVCachePool`, all at
        position ``step.start`` -- returns logits ``[B, T, vocab]`` and advances the sequences. Sharded
        layers gather their weights exactly as in :meth:`forward`."""
        b, t = tokens.shape
        if (b, t) != (step.count, step.new):
            raise InvalidArgument(f"forward_cached: tokens {list(tokens.shape)} do not match the step's {step.count} "
                             f"sequences x {step.new} new tokens")
        h = self.embed(tokens).reshape(b * t, -1)
        h = run_layers(self.layers, h, self.planner, call=lambda layer, x: layer.forward_cached(x, step))
        out = self.lm_head(self.norm(h)).view(b, t, -1)
        step.advance()
        return out

    def forward_serve(self, step: ServeStep) -> torch.Tensor:
        """The serving path: one forward of ``step.rows`` rows of different sequences at different
        positions, K/V in a :class:`~wsharding.models.serve_step.KVRows`; returns logits
        ``[rows, vocab]``. Sharded layers gather their weights exactly as in :meth:`forward`."""
        h = self.embed(step.tokens)
        h = run_layers(self.layers, h, self.planner, call=lambda layer, x: layer.forward_serve(x, step))
        return self.lm_head(self.norm(h))

    def dummy_tokens(self) -> torch.Tensor:
        """One token, for a rank with no work this step (see :func:`wsharding.core.runner.aligned_forward`)."""
        return torch.zeros(1, dtype=torch.long, device=self.embed.weight.device)


def _init_(module: nn.Module, gen: torch.Generator, device: torch.device | str) -> None:
    """Fill every floating parameter from ``gen`` (scaled normal), on CPU then copied: the same bits
    on every rank and every device. A quantized linear draws the same float weight (in its
    ``params_dtype``) and stores its quant method's quantization of it (weights and scales)."""
    with torch.no_grad():
        for mod_name, mod in module.named_modules():
            quantized = isinstance(mod, LinearBase) and not isinstance(mod.quant_method, UnquantizedLinearMethod)
            for pname, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{pname}" if mod_name else pname
                if quantized:
                    if pname == "weight":
                        w = (torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5).to(mod.params_dtype)
                        for k, v in mod.quant_method.quantize(mod, w).items():
                            getattr(mod, k).data.copy_(v.reshape(getattr(mod, k).shape).to(device))
                    continue
                if p.dtype.is_floating_point:
                    if "norm" in name:
                        p.fill_(1.0)
                        continue
                    fan_in = p.shape[-1] if p.dim() > 1 else 1
                    p.copy_((torch.randn(p.shape, generator=gen) / fan_in**0.5).to(p.dtype).to(device))


def decoder_config(preset: str | DecoderConfig, layers: int | None = None) -> DecoderConfig:
    """A preset's :class:`DecoderConfig` (or ``preset`` itself), with ``layers`` overriding its depth."""
    if isinstance(preset, DecoderConfig):
        cfg = preset
    else:
        if preset not in PRESETS:
            raise InvalidArgument(f"preset: unknown decoder preset {preset!r}; known: {sorted(PRESETS)}")
        cfg = PRESETS[preset]
    if layers is not None:
        if layers < 2:
            raise InvalidArgument(f"layers: need at least 2 (a dense layer 0 and one sharded layer), got {layers}")
        cfg = cfg.with_(layers=layers)
    return cfg


#: variant name -> quant method name of the toy decoder's targets
VARIANTS: dict[str, str] = {"bf16": "none", "int8": "int8", "fp8": "fp8", "fp8_block": "fp8_block"}

def variant_config(preset: str | DecoderConfig, variant: str, layers: int | None = None) -> DecoderConfig:
    """The decoder preset with the targets quantized as ``variant`` (a key of :data:`VARIANTS`)."""
    if variant not in VARIANTS:
        raise InvalidArgument(f"variant: unknown {variant!r}; known: {sorted(VARIANTS)}")
    cfg = decoder_config(preset, layers).with_(quant=VARIANTS[variant])
    if variant == "fp8_block":
        # 128 x 128 blocks where the dimensions allow it (the weight-sharding design's block), else the
        # largest edge that divides
        dims = [cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.latent, cfg.shared_inter,
                cfg.dense_inter]
        cfg = cfg.with_(quant_block=next(b for b in (128, 64, 48, 32, 16, 8) if all(d % b == 0 for d in dims)))
    return cfg


def build_pair(cfg: DecoderConfig, comm: Communicator, *, seed: int = 0, lookahead: bool = True, trace: bool = False,
               sharded_layers: range | None = None, map_own_chunk: bool | str = "auto") -> tuple[ToyDecoder, ToyDecoder]:
    """The replicated model and its sharded twin (same seed: the same weights) on this rank.

    The weight-sharding design's default range leaves the dense layer 0 out: layers 1..L-1 are sharded.
    ``map_own_chunk``: :class:`~wsharding.core.sharding.WeightSharding`'s (no own-chunk copy per gather; "auto" by default).
    """
    device = comm.device
    replicated = ToyDecoder(cfg, seed=seed, device=device).eval()
    process_weights(replicated)
    ws = WeightSharding(comm, sharded_layers=sharded_layers or range(1, cfg.layers), lookahead=lookahead, trace=trace,
                        map_own_chunk=map_own_chunk)
    sharded = ToyDecoder(cfg, seed=seed, weight_sharding=ws, device=device).eval()
    process_weights(sharded)  # the linears that stay replicated; the sharded ones are processed by finalize
    ws.finalize()
    return replicated, sharded
