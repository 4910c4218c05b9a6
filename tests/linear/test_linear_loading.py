"""Loaders v1 and v2, presharded checkpoints, padding, quantised parameter classes, shape errors.

Every rank of a P-rank group is built in this process with a LogicalGroup: loading needs no
communicator, and the rank's parameter must equal its slice of the checkpoint bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from wsharding.linear import (
    CheckpointShapeError,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelState,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    pad_or_narrow,
)
from wsharding.linear.quant import (
    BlockInt8LinearMethod,
    PackedInt4LinearMethod,
    quantize_block_int8,
    quantize_int4_per_tensor,
    unpack_int4_rows,
)


def load(layer, name, t, shard=None):
    p = getattr(layer, name)
    p.weight_loader(p, t, shard)


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_qkv_loaders_every_rank(P, v2):
    H, K, hs = 16, 4, 2
    q, k, v = (torch.arange(n * hs * 3, dtype=torch.float32).reshape(n * hs, 3) + 1000 * i
               for i, n in enumerate((H, K, K)))
    for r in range(P):
        qkv = QKVParallelLinear(3, hs, H, K, bias=False, parallel_state=ParallelState.logical(P, r),
                                quant_method=UnquantizedLinearMethod(use_v2=v2))
        for s, t in zip("qkv", (q, k, v), strict=True):
            load(qkv, "weight", t, s)
        want = torch.cat([src[ck:ck + n] for (_, _, n, ck), src in zip(qkv.row_sub_blocks(), (q, k, v), strict=True)])
        assert torch.equal(qkv.weight, want)
        qs = H * hs // P
        assert torch.equal(qkv.weight[:qs], q[r * qs:(r + 1) * qs])


def test_merged_v1_v2_fused_and_presharded_agree():
    gate, up = torch.randn(8, 4), torch.randn(16, 4)
    for r in range(4):
        st = ParallelState.logical(4, r)
        layers = [MergedColumnParallelLinear(4, [8, 16], bias=False, parallel_state=st,
                                             quant_method=UnquantizedLinearMethod(use_v2=v2)) for v2 in (False, True)]
        fused = [MergedColumnParallelLinear(4, [8, 16], bias=False, parallel_state=st,
                                            quant_method=UnquantizedLinearMethod(use_v2=v2)) for v2 in (False, True)]
        pre = MergedColumnParallelLinear(4, [8, 16], bias=False, parallel_state=st, use_presharded_weights=True)
        for lay in layers:
            load(lay, "weight", gate, 0)
            load(lay, "weight", up, 1)
        for lay in fused:
            load(lay, "weight", torch.cat([gate, up]))
        # Presharded: the checkpoint holds this rank's rows; the fused split uses per-rank offsets.
        load(pre, "weight", torch.cat([gate[2 * r:2 * r + 2], up[4 * r:4 * r + 4]]))
        want = torch.cat([gate[2 * r:2 * r + 2], up[4 * r:4 * r + 4]])
        for lay in (*layers, *fused, pre):
            assert torch.equal(lay.weight, want)
        assert layers[0].row_sub_blocks() == [(0, 0, 2, 2 * r), (1, 2, 4, 4 * r)]
        assert pre.row_sub_blocks() == [(0, 0, 2, 0), (1, 2, 4, 0)]


def test_presharded_is_not_sliced_twice():
    """What breaks without the presharded flag: the per-rank tensor is refused as a wrong shape."""
    st = ParallelState.logical(4, 3)
    shard = torch.randn(2, 6)
    col = ColumnParallelLinear(6, 8, bias=False, parallel_state=st, use_presharded_weights=True)
    load(col, "weight", shard)
    assert torch.equal(col.weight, shard)
    plain = ColumnParallelLinear(6, 8, bias=False, parallel_state=st)
    with pytest.raises(CheckpointShapeError, match=r"expected \(8, 6\)"):
        load(plain, "weight", shard)
    qkv = QKVParallelLinear(6, 2, 8, 4, bias=False, parallel_state=st, load_presharded_attn=True,
                            quant_method=UnquantizedLinearMethod(use_v2=True))
    q, k = torch.randn(4, 6), torch.randn(2, 6)
    load(qkv, "weight", q, "q")
    load(qkv, "weight", k, "k")
    assert torch.equal(qkv.weight[:4], q) and torch.equal(qkv.weight[4:6], k)
    row = RowParallelLinear(8, 3, bias=False, parallel_state=st, use_presharded_weights=True)
    w = torch.randn(3, 2)
    load(row, "weight", w)
    assert torch.equal(row.weight, w)


def test_pad_or_narrow():
    t = torch.arange(10.0)
    assert torch.equal(pad_or_narrow(t, 0, 4, 3), torch.tensor([4.0, 5, 6]))
    assert torch.equal(pad_or_narrow(t, 0, 8, 4), torch.tensor([8.0, 9, 0, 0]))
    assert torch.equal(pad_or_narrow(t, 0, 12, 2), torch.zeros(2))


@pytest.mark.parametrize("v2", [False, True])
def test_padding_when_the_group_does_not_divide(v2):
    """Row: 10 input columns on 4 ranks -> 3 each, the last rank holds one real column + 2 zero columns;
    the sum of the ranks' partial products is the full product."""
    W, x = torch.randn(5, 10), torch.randn(2, 10)
    total = torch.zeros(2, 5)
    for r in range(4):
        row = RowParallelLinear(10, 5, bias=False, input_is_parallel=False, allow_padding=True,
                                parallel_state=ParallelState.logical(4, r), quant_method=UnquantizedLinearMethod(v2))
        load(row, "weight", W)
        total += row(x, skip_all_reduce=True)
        if r == 3:
            assert torch.equal(row.weight[:, 1:], torch.zeros(5, 2))
    assert torch.allclose(total, x @ W.T, atol=1e-5)
    with pytest.raises(Exception, match="not divisible"):
        RowParallelLinear(10, 5, parallel_state=ParallelState.logical(4, 0))


@pytest.mark.parametrize(
    ("build", "name", "tensor", "shard", "expected"),
    [
        (lambda: ColumnParallelLinear(6, 8, prefix="mlp.up", parallel_state=ParallelState.logical(2, 0)), "weight",
         torch.zeros(8, 5), None, r"mlp\.up\.weight.*\(8, 5\), expected \(8, 6\)"),
        (lambda: QKVParallelLinear(6, 2, 4, 2, prefix="attn.qkv", parallel_state=ParallelState.logical(2, 1)), "weight",
         torch.zeros(3, 6), "k", r"attn\.qkv\.weight \(shard k\).*\(3, 6\), expected \(4, 6\)"),
        (lambda: QKVParallelLinear(6, 2, 4, 2, prefix="attn.qkv", parallel_state=ParallelState.logical(2, 1),
                                   quant_method=UnquantizedLinearMethod(use_v2=True)), "weight",
         torch.zeros(3, 6), "k", r"attn\.qkv\.weight.*\(3, 6\), expected \(4, 6\)"),
        (lambda: RowParallelLinear(8, 3, prefix="o_proj", parallel_state=ParallelState.logical(4, 0)), "weight",
         torch.zeros(3, 4), None, r"o_proj\.weight.*\(3, 4\), expected \(3, 8\)"),
        (lambda: RowParallelLinear(8, 3, prefix="o_proj", parallel_state=ParallelState.logical(4, 0)), "bias",
         torch.zeros(4), None, r"o_proj\.bias.*\(4,\), expected \(3,\)"),
        (lambda: MergedColumnParallelLinear(4, [8, 8], prefix="gate_up", parallel_state=ParallelState.logical(2, 0),
                                            quant_method=UnquantizedLinearMethod(use_v2=True)), "weight",
         torch.zeros(17, 4), None, r"gate_up\.weight.*\(17, 4\), expected \(16, 4\)"),
    ],
)
def test_wrong_checkpoint_shape_names_param_expected_and_actual(build, name, tensor, shard, expected):
    layer = build()
    with pytest.raises(CheckpointShapeError, match=expected):
        load(layer, name, tensor, shard)


def test_bad_shard_id():
    m = MergedColumnParallelLinear(4, [8, 8])
    with pytest.raises(ValueError, match=r"loaded_shard_id must be an int in \[0, 2\)"):
        load(m, "weight", torch.zeros(8, 4), 2)
    with pytest.raises(ValueError, match="'q', 'k', 'v'"):
        load(QKVParallelLinear(4, 2, 2), "weight", torch.zeros(4, 4), "x")


def test_block_scale_uses_ceiling_division():
    """Scale rows of a sub-block are [ceil(off/bn), +ceil(size/bn)); 20 rows with block 8 -> 3 scale rows."""
    w = torch.randn(20, 16)
    q, s = quantize_block_int8(w, (8, 8))
    assert tuple(s.shape) == (3, 2)
    lay = ColumnParallelLinear(16, 20, bias=False, parallel_group="replicated", quant_method=BlockInt8LinearMethod((8, 8)))
    load(lay, "weight", q)
    load(lay, "weight_scale_inv", s)
    assert torch.equal(lay.weight_scale_inv, s)
    assert torch.allclose(lay.quant_method.dequantized_weight(lay), w, atol=float(s.max()))
    # merged, 2 ranks: each 16-row sub-tensor -> 8 rows per rank -> 1 scale row, at ceil(offset / 8)
    g, u = torch.randn(16, 16), torch.randn(16, 16)
    (_qg, sg), (_qu, su) = quantize_block_int8(g, (8, 8)), quantize_block_int8(u, (8, 8))
    m = MergedColumnParallelLinear(16, [16, 16], bias=False, parallel_state=ParallelState.logical(2, 1),
                                   quant_method=BlockInt8LinearMethod((8, 8)))
    load(m, "weight_scale_inv", sg, 0)
    load(m, "weight_scale_inv", su, 1)
    assert torch.equal(m.weight_scale_inv, torch.stack([sg[1], su[1]]))
    with pytest.raises(TypeError, match="only be loaded by weight_loader_v2"):
        m.weight_loader(m.weight_scale_inv, sg, 0)


def test_packed_int4_pack_factor_offsets():
    t = torch.randn(32, 4)
    packed, scale = quantize_int4_per_tensor(t)
    assert tuple(packed.shape) == (4, 4)
    assert torch.equal(unpack_int4_rows(packed).float() * scale, torch.round(t / scale).clamp(-8, 7) * scale)
    for r in range(2):
        col = ColumnParallelLinear(4, 32, bias=False, parallel_state=ParallelState.logical(2, r),
                                   quant_method=PackedInt4LinearMethod())
        load(col, "qweight", packed)
        load(col, "weight_scale", scale)
        assert torch.equal(col.qweight, packed[2 * r:2 * r + 2])  # 16 logical rows = 2 packed rows
    with pytest.raises(ValueError, match="not a multiple of the pack factor 8"):
        ColumnParallelLinear(4, 32, parallel_state=ParallelState.logical(8, 0), quant_method=PackedInt4LinearMethod())


def test_output_tensor_without_apply_into_is_refused():
    row = RowParallelLinear(8, 4, quant_method=BlockInt8LinearMethod((4, 4)))
    with pytest.raises(RuntimeError, match="BlockInt8LinearMethod cannot write into a caller-owned"):
        row(torch.zeros(1, 8), output_tensor=torch.empty(1, 4))
