"""Rank tasks for the linear contract: split linears on real ranks against a single-rank reference.

Every rank builds the same full checkpoint tensors from one seed, loads its part through the linears'
loaders and runs forward; the reference is ``F.linear`` on the full tensors. Column-type outputs are
compared bitwise: their inputs and weights are dyadic (multiples of 1/8 in [-1, 1]) so every product
and sum is exact in fp32 whatever order a kernel uses. Row outputs are all-reduced sums of gaussian
data, compared within an fp32 tolerance.

Run them with ``RankCluster.run(linear_contract_task)``; on CPU ranks the report says it is emulated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wsharding.core.context import RankContext
from wsharding.linear.column import ColumnParallelLinear, MergedColumnParallelLinear
from wsharding.linear.groups import ParallelState, ReplicatedParallelGroup
from wsharding.linear.qkv import QKVParallelLinear
from wsharding.linear.quant import (
    BlockInt8LinearMethod,
    Int8PerChannelLinearMethod,
    PackedInt4LinearMethod,
    UnquantizedLinearMethod,
    quantize_block_int8,
    quantize_int4_per_tensor,
    quantize_per_channel_int8,
    unpack_int4_rows,
)
from wsharding.linear.row import RowParallelLinear, skip_mlp_all_reduce

#: fp32 tolerance for a sum over ranks of partial GEMMs (order of additions differs from the reference).
REDUCE_ATOL = 1e-4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dyadic(*shape: int, seed: int) -> torch.Tensor:
    """Values k/8, k in [-8, 8]: fp32 GEMMs on them are exact, so split and reference agree bitwise."""
    return torch.randint(-8, 9, shape, generator=_gen(seed)).float() / 8


def gaussian(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: object = None) -> None:
    p = getattr(layer, name)
    p.weight_loader(p, tensor, shard)


def column_cases(ctx: RankContext, state: ParallelState) -> dict[str, Any]:
    """Column, merged and QKV linears (v1 and v2 loaders), gather_output, replicated groups: all exact."""
    P, r = state.tp_size, state.tp_rank
    exact: dict[str, bool] = {}
    x = dyadic(5, 32, seed=1)

    W, b = dyadic(48, 32, seed=2), dyadic(48, seed=3)
    ref = F.linear(x, W, b)
    for v2 in (False, True):
        col = ColumnParallelLinear(32, 48, gather_output=True, parallel_state=state, prefix="col",
                                   quant_method=UnquantizedLinearMethod(use_v2=v2))
        _load(col, "weight", W)
        _load(col, "bias", b)
        exact[f"column gather v{1 + v2}"] = torch.equal(col(x), ref)
        col.gather_output = False
        s = 48 // P
        exact[f"column slice v{1 + v2}"] = torch.equal(col(x), ref[:, r * s:(r + 1) * s])

    gate, up = dyadic(48, 32, seed=4), dyadic(24, 32, seed=5)
    ref_g, ref_u = F.linear(x, gate), F.linear(x, up)
    for v2 in (False, True):
        m = MergedColumnParallelLinear(32, [48, 24], bias=False, parallel_state=state, prefix="gate_up",
                                       quant_method=UnquantizedLinearMethod(use_v2=v2))
        if v2:
            _load(m, "weight", torch.cat([gate, up]))  # a fused checkpoint tensor
        else:
            _load(m, "weight", gate, 0)
            _load(m, "weight", up, 1)
        g, u = 48 // P, 24 // P
        want = torch.cat([ref_g[:, r * g:(r + 1) * g], ref_u[:, r * u:(r + 1) * u]], dim=-1)
        exact[f"merged v{1 + v2}"] = torch.equal(m(x), want)
        exact[f"merged row_sub_blocks v{1 + v2}"] = m.row_sub_blocks() == [(0, 0, g, r * g), (1, g, u, r * u)]

    kv_partner_equal = True
    for H, K, hs in ((16, 4, 4), (8, 8, 2)):
        q, k, v = dyadic(H * hs, 32, seed=6), dyadic(K * hs, 32, seed=7), dyadic(K * hs, 32, seed=8)
        bq = dyadic((H + 2 * K) * hs, seed=9)
        for v2 in (False, True):
            qkv = QKVParallelLinear(32, hs, H, K, parallel_state=state, prefix="qkv",
                                    quant_method=UnquantizedLinearMethod(use_v2=v2))
            if v2:
                _load(qkv, "weight", torch.cat([q, k, v]))
                _load(qkv, "bias", bq)
            else:
                for sid, t in zip("qkv", (q, k, v), strict=True):
                    _load(qkv, "weight", t, sid)
                _load(qkv, "bias", bq)
            nh, nkv = qkv.num_heads, qkv.num_kv_heads
            kb = r // qkv.num_kv_head_replicas
            qs, ks = nh * hs, nkv * hs
            w_want = torch.cat([q[r * qs:(r + 1) * qs], k[kb * ks:(kb + 1) * ks], v[kb * ks:(kb + 1) * ks]])
            bqs, bks, bvs = bq[: H * hs], bq[H * hs:(H + K) * hs], bq[(H + K) * hs:]
            b_want = torch.cat([bqs[r * qs:(r + 1) * qs], bks[kb * ks:(kb + 1) * ks], bvs[kb * ks:(kb + 1) * ks]])
            exact[f"qkv H{H} K{K} v{1 + v2}"] = torch.equal(qkv(x), F.linear(x, w_want, b_want))
            # The replica check of the parallel contract of SGLang's Linear layers, on ranks: the K rows of
            # replica partners are equal.
            k_rows = qkv.weight[qs:qs + ks].contiguous()
            parts = [torch.empty_like(k_rows) for _ in range(P)]
            dist.all_gather(parts, k_rows)
            rep = qkv.num_kv_head_replicas
            for j in range(P):
                kv_partner_equal &= torch.equal(parts[j], parts[(j // rep) * rep])

    # ReplicatedParallelGroup: consecutive pairs share a partition; the gather keeps one block each.
    if P >= 2:
        rcol = ColumnParallelLinear(32, 48, gather_output=True, parallel_state=state,
                                    parallel_group=ReplicatedParallelGroup("tp", 2), prefix="rcol")
        _load(rcol, "weight", W)
        _load(rcol, "bias", b)
        exact["replicated-group column gather"] = torch.equal(rcol(x), ref) and rcol.tp_size == P // 2
    return {"exact": exact, "kv_partner_equal": kv_partner_equal}


def row_cases(ctx: RankContext, state: ParallelState) -> dict[str, Any]:
    """Row linears: reduction within fp32 tolerance, bias once, skip switches, output_tensor, replicas."""
    P = state.tp_size
    err: dict[str, float] = {}
    flags: dict[str, bool] = {}
    x, W, b = gaussian(6, 64, seed=11), gaussian(24, 64, seed=12), gaussian(24, seed=13)
    ref, ref_nb = F.linear(x, W, b), F.linear(x, W)
    s = 64 // P
    x_r = x[:, state.tp_rank * s:(state.tp_rank + 1) * s]
    for v2 in (False, True):
        row = RowParallelLinear(64, 24, input_is_parallel=False, parallel_state=state, prefix="down",
                                quant_method=UnquantizedLinearMethod(use_v2=v2))
        _load(row, "weight", W)
        _load(row, "bias", b)
        err[f"row bias v{1 + v2}"] = _err(row(x), ref)
        out = torch.empty(6, 24)
        row(x, output_tensor=out)
        err[f"row output_tensor v{1 + v2}"] = _err(out, ref)
    nb = RowParallelLinear(64, 24, bias=False, parallel_state=state, prefix="o_proj")
    _load(nb, "weight", W)
    err["row no bias, input_is_parallel"] = _err(nb(x_r), ref_nb)
    # reduce_results=False / skip_all_reduce / the forward flag: partial sums come back, caller reduces.
    boundary = RowParallelLinear(64, 24, reduce_results=False, parallel_state=state, prefix="o_boundary")
    _load(boundary, "weight", W)
    _load(boundary, "bias", b)
    for name, partial in (("reduce_results=False", boundary(x_r)), ("skip_all_reduce", nb(x_r, skip_all_reduce=True))):
        with_sum = partial.clone()
        dist.all_reduce(with_sum)
        want = ref if name == "reduce_results=False" else ref_nb
        err[f"{name} then caller all-reduce"] = _err(with_sum, want)
        flags[f"{name} leaves a partial sum"] = P == 1 or _err(partial, want) > 1e-3
    with skip_mlp_all_reduce():
        flags["skip_mlp_all_reduce leaves a partial sum"] = P == 1 or _err(nb(x_r), ref_nb) > 1e-3
    # Bias counted once: with a zero weight the output is exactly the bias...
    zero = RowParallelLinear(64, 24, parallel_state=state, prefix="zero")
    _load(zero, "weight", torch.zeros(24, 64))
    _load(zero, "bias", b)
    flags["bias counted once (exact)"] = torch.equal(zero(x_r), b.expand(6, 24))
    # ...and without the rank-0 guard it would be counted P times.
    unguarded = F.linear(x_r, torch.zeros(24, s), b)
    dist.all_reduce(unguarded)
    flags["without the rank-0 guard bias counts P times"] = torch.allclose(unguarded, P * b.expand(6, 24))
    if P >= 2:
        rrow = RowParallelLinear(64, 24, input_is_parallel=False, parallel_state=state, prefix="rrow",
                                 parallel_group=ReplicatedParallelGroup("tp", 2))
        _load(rrow, "weight", W)
        _load(rrow, "bias", b)
        err["replicated-group row"] = _err(rrow(x), ref)
    return {"err": err, "flags": flags}


def quant_cases(ctx: RankContext, state: ParallelState) -> dict[str, Any]:
    """v2 parameter classes on ranks: each rank's dequantised weight equals its slice of the reference's."""
    r, P = state.tp_rank, state.tp_size
    exact: dict[str, bool] = {}
    W = gaussian(64, 32, seed=21)
    ref_c = ColumnParallelLinear(32, 64, bias=False, parallel_group="replicated", quant_method=Int8PerChannelLinearMethod())
    col = ColumnParallelLinear(32, 64, bias=False, parallel_state=state, quant_method=Int8PerChannelLinearMethod())
    qw, sc = quantize_per_channel_int8(W)
    for lay in (ref_c, col):
        _load(lay, "weight", qw)
        _load(lay, "weight_scale", sc)
    s = 64 // P
    exact["int8 per-channel column"] = torch.equal(col.quant_method.dequantized_weight(col),
                                                   ref_c.quant_method.dequantized_weight(ref_c)[r * s:(r + 1) * s])

    block = (8, 8)
    g, u = gaussian(64, 32, seed=22), gaussian(64, 32, seed=23)
    (qg, sg), (qu, su) = quantize_block_int8(g, block), quantize_block_int8(u, block)
    m = MergedColumnParallelLinear(32, [64, 64], bias=False, parallel_state=state, quant_method=BlockInt8LinearMethod(block))
    _load(m, "weight", qg, 0)
    _load(m, "weight", qu, 1)
    _load(m, "weight_scale_inv", sg, 0)
    _load(m, "weight_scale_inv", su, 1)
    deq = lambda q_, s_: q_.float() * s_.repeat_interleave(8, 0).repeat_interleave(8, 1)  # noqa: E731
    want = torch.cat([deq(qg, sg)[r * s:(r + 1) * s], deq(qu, su)[r * s:(r + 1) * s]])
    exact["int8 block-scale merged"] = torch.equal(m.quant_method.dequantized_weight(m), want)

    rw = gaussian(16, 64, seed=24)
    qr, sr = quantize_block_int8(rw, block)
    row = RowParallelLinear(64, 16, bias=False, parallel_state=state, quant_method=BlockInt8LinearMethod(block))
    _load(row, "weight", qr)
    _load(row, "weight_scale_inv", sr)
    k = 64 // P
    exact["int8 block-scale row"] = torch.equal(row.quant_method.dequantized_weight(row), deq(qr, sr)[:, r * k:(r + 1) * k])

    H, K, hs = 8, 8, 8
    tensors = [gaussian(n * hs, 32, seed=25 + i) for i, n in enumerate((H, K, K))]
    qkv = QKVParallelLinear(32, hs, H, K, bias=False, parallel_state=state, quant_method=PackedInt4LinearMethod())
    deq_parts = []
    for sid, t in zip("qkv", tensors, strict=True):
        packed, scale = quantize_int4_per_tensor(t)
        _load(qkv, "qweight", packed, sid)
        _load(qkv, "weight_scale", scale, sid)
        n = qkv.shard_size(sid)
        blk = qkv.checkpoint_block(sid)
        deq_parts.append(unpack_int4_rows(packed).float()[blk * n:(blk + 1) * n] * scale)
    exact["int4 packed qkv"] = torch.equal(qkv.quant_method.dequantized_weight(qkv), torch.cat(deq_parts))
    return {"exact": exact}


def dp_attention_cases(ctx: RankContext) -> dict[str, Any]:
    """TP = world, attn_dp = 2: o_proj reduces inside each DP replica; reducing on the full TP group mixes
    the replicas' different requests (what breaks without ``use_dp_attention_reduce``)."""
    state = ParallelState.from_dist(ctx, attn_dp_size=2)
    dp = state.attn_dp_rank
    x = gaussian(4, 32, seed=100 + dp)  # each replica serves different requests
    W = gaussian(16, 32, seed=31)
    ref = F.linear(x, W)
    a = state.attn_tp_size
    x_r = x[:, state.attn_tp_rank * (32 // a):(state.attn_tp_rank + 1) * (32 // a)]
    o = RowParallelLinear(32, 16, bias=False, parallel_group="attn_tp", use_dp_attention_reduce=True,
                          parallel_state=state, prefix="o_proj")
    _load(o, "weight", W)
    good = _err(o(x_r), ref)
    wrong = RowParallelLinear(32, 16, bias=False, parallel_group="attn_tp", parallel_state=state, prefix="o_wrong")
    wrong.reduce_group_override = state.tp_group
    _load(wrong, "weight", W)
    bad = _err(wrong(x_r), ref)
    return {"dp_rank": dp, "attn_tp_size": a, "reduce_group_size": o.reduce_group.world_size,
            "attn_tp_members": list(o.reduce_group.ranks), "err": good, "err_full_group": bad}


def linear_contract_task(ctx: RankContext) -> dict[str, Any]:
    """Everything multi-rank about the linear contract, in one task (one round trip per world size)."""
    state = ParallelState.from_dist(ctx)
    out: dict[str, Any] = {"rank": ctx.rank, "world_size": ctx.world_size, "mode": ctx.mode,
                           "emulation": ctx.emulation}
    out["column"] = column_cases(ctx, state)
    out["row"] = row_cases(ctx, state)
    out["quant"] = quant_cases(ctx, state)
    if ctx.world_size >= 4:
        out["dp_attention"] = dp_attention_cases(ctx)
    return out


def tp_forward_task(ctx: RankContext, hidden: int = 64, inter: int = 128, tokens: int = 8) -> dict[str, Any]:
    """A tiny TP MLP (gate_up merged column, SiLU*mul, down row) on every rank vs the one-rank reference."""
    state = ParallelState.from_dist(ctx)
    x = gaussian(tokens, hidden, seed=41)
    gate, up, down = gaussian(inter, hidden, seed=42), gaussian(inter, hidden, seed=43), gaussian(hidden, inter, seed=44)
    ref = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    gu = MergedColumnParallelLinear(hidden, [inter, inter], bias=False, parallel_state=state, prefix="mlp.gate_up_proj")
    dn = RowParallelLinear(inter, hidden, bias=False, parallel_state=state, prefix="mlp.down_proj")
    _load(gu, "weight", gate, 0)
    _load(gu, "weight", up, 1)
    _load(dn, "weight", down)
    g, u = gu(x).chunk(2, dim=-1)
    y = dn(F.silu(g) * u)
    return {"rank": ctx.rank, "mode": ctx.mode, "emulation": ctx.emulation, "tp_size": gu.tp_size,
            "gate_up_weight": list(gu.weight.shape), "down_weight": list(dn.weight.shape),
            "max_abs_err": _err(y, ref), "ref_norm": float(ref.norm())}
