"""FP8 quant methods: the UE8M0 requant and the ModelOpt max-scale requant against an independent
reference (pure Python e4m3 rounding, exact bytes), and the errors a bad quantized weight gets."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from wsharding.core.comm import Communicator
from wsharding.core.sharding import ShardingError, WeightSharding
from wsharding.linear import MergedColumnParallelLinear, QuantError, ReplicatedLinear
from wsharding.linear.fp8 import (
    FP8,
    BlockFp8LinearMethod,
    Fp8PerTensorLinearMethod,
    fp8_gemm_path,
    pow2_ceil,
    requant_per_tensor_rows,
    requant_ue8m0,
    ue8m0_codes,
)
from wsharding.linear.quant import LinearMethodBase, PackedInt4LinearMethod


# ---- an independent e4m3 reference: bit patterns decoded by hand, rounding by search ---------------
def e4m3_decode(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


FINITE = [(c, e4m3_decode(c)) for c in range(256) if not math.isnan(e4m3_decode(c))]


def e4m3_round(x: float) -> int:
    """Nearest e4m3 code, ties to the even mantissa, saturating at +-448 (0 keeps its sign)."""
    negative = math.copysign(1.0, x) < 0
    x = max(-448.0, min(448.0, x))
    best = min(FINITE, key=lambda cv: (abs(cv[1] - x), cv[0] & 1, (cv[0] & 0x80 != 0) != negative))
    return best[0]


def f32(x: float) -> float:
    """Round a Python float (double) to float32, once, as IEEE does."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def pow2_ceil_ref(s: float) -> float:
    m, e = math.frexp(s)
    return s if m == 0.5 else 2.0**e


def random_fp8(shape, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaNs
    return codes.view(FP8)


def test_e4m3_reference_agrees_with_torch_on_every_code():
    codes = torch.tensor([c for c, _ in FINITE], dtype=torch.uint8)
    assert codes.view(FP8).float().tolist() == [v for _, v in FINITE]


def test_pow2_ceil_is_exact():
    s = torch.tensor([0.5, 1.0, 3.0, 0.3, 2.0**-20, 1.0000001, 447.0, 2.0**-126 * 3], dtype=torch.float32)
    assert pow2_ceil(s).tolist() == [pow2_ceil_ref(f32(v)) for v in s.tolist()]
    assert ue8m0_codes(pow2_ceil(s)).tolist() == [int(math.log2(pow2_ceil_ref(f32(v)))) + 127 for v in s.tolist()]
    with pytest.raises(QuantError, match="power of two"):
        ue8m0_codes(torch.tensor([3.0]))


@pytest.mark.parametrize("shape, block", [((8, 12), (4, 4)), ((10, 6), (4, 4)), ((16, 16), (8, 16))])
def test_ue8m0_requant_matches_reference_bytes(shape, block):
    w = random_fp8(shape, seed=sum(shape))
    bn, bk = block
    g = torch.Generator().manual_seed(3)
    scale = (torch.rand(math.ceil(shape[0] / bn), math.ceil(shape[1] / bk), generator=g) * 0.02 + 1e-4).float()
    scale[0, 0] = 0.125  # a scale that is already a power of two stays
    ref = w.view(torch.uint8).clone()
    for r in range(shape[0]):
        for c in range(shape[1]):
            s = float(scale[r // bn, c // bk])
            s2 = pow2_ceil_ref(s)
            deq = f32(e4m3_decode(int(ref[r, c])) * s)  # float32(q * s)
            ref[r, c] = e4m3_round(deq / s2)  # exact division by a power of two, then e4m3
    new = requant_ue8m0(w, scale, block)
    assert torch.equal(w.view(torch.uint8), ref)
    assert new.tolist() == [[pow2_ceil_ref(float(s)) for s in row] for row in scale]
    assert new[0, 0] == 0.125


def test_modelopt_max_scale_requant_matches_reference_bytes():
    w = random_fp8((12, 8), seed=5)
    scales = torch.tensor([0.01, 0.03, 0.02], dtype=torch.float32)
    target = scales.max()
    ref = w.view(torch.uint8).clone()
    for r in range(12):
        s = float(scales[r // 4])
        if s != float(target):
            ref[r] = torch.tensor([e4m3_round(f32(e4m3_decode(int(c)) * s) / float(target)) for c in ref[r]])
    requant_per_tensor_rows(w, [4, 4, 4], scales, target)
    assert torch.equal(w.view(torch.uint8), ref)


def _fp8_merged() -> MergedColumnParallelLinear:
    return MergedColumnParallelLinear(32, [16, 16], bias=False, params_dtype=torch.bfloat16,
                                      parallel_group="replicated", quant_method=Fp8PerTensorLinearMethod(),
                                      prefix="mlp.gate_up_proj")


def test_fp8_per_tensor_needs_processing_and_one_scale_per_shard():
    layer = _fp8_merged()
    w = torch.randn(32, 32)
    for k, v in layer.quant_method.quantize(layer, w).items():
        getattr(layer, k).data.copy_(v)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with pytest.raises(QuantError, match=r"mlp.gate_up_proj: 2 weight scales .*process_weights_after_loading"):
        layer(x)
    layer.process_weights_after_loading()
    assert layer.weight_scale.shape == (1,) and layer(x).shape == (3, 32)
    assert fp8_gemm_path(x, layer.weight) == "reference"  # CPU
    bad = _fp8_merged()
    bad.weight_scale.data = torch.ones(3)
    with pytest.raises(QuantError, match=r"mlp.gate_up_proj.weight_scale has shape \(3,\).*one scale per logical shard \(2\)"):
        bad.process_weights_after_loading()


def test_block_fp8_scale_shape_and_block_size_errors():
    layer = ReplicatedLinear(32, 16, bias=False, quant_method=BlockFp8LinearMethod((8, 8)), prefix="o_proj")
    layer.weight_scale_inv.data = torch.ones(2, 2)
    with pytest.raises(QuantError, match=r"o_proj.weight_scale_inv has shape \(2, 2\), expected \(2, 4\)"):
        layer.process_weights_after_loading()
    with pytest.raises(QuantError, match=r"gate_up: output partition 0 has 12 rows, not a multiple of block_n 8"):
        MergedColumnParallelLinear(32, [12, 12], bias=False, parallel_group="replicated",
                                   quant_method=BlockFp8LinearMethod((8, 8)), prefix="gate_up")


class _OneOfTwo(Communicator):
    rank, world_size, device, mode = 0, 2, torch.device("cpu"), "cpu-gloo"


def test_unshardable_quant_method_is_refused_by_name():
    block = torch.nn.Module()
    block.proj = ReplicatedLinear(16, 16, bias=False, quant_method=PackedInt4LinearMethod(), prefix="proj")
    with pytest.raises(ShardingError, match=r"target 'proj' uses PackedInt4LinearMethod, which weight sharding "
                                            r"cannot shard: its weight is `qweight`"):
        WeightSharding(_OneOfTwo(), [block], {0: ["proj"]})


class _ChangesFormat(LinearMethodBase):
    """A method whose after-loading step turns the weight into another dtype: cannot be sharded."""

    uses_weight_loader_v2 = False

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        from wsharding.linear.parameters import ModelWeightParameter

        layer.register_parameter("weight", ModelWeightParameter(
            torch.zeros(sum(output_partition_sizes), input_size_per_partition), weight_loader))

    def process_weights_after_loading(self, layer):
        layer.weight.data = layer.weight.data.to(torch.bfloat16)


def test_processing_that_changes_the_weight_format_is_refused(cluster_of):
    results = cluster_of(2).run(finalize_changing_format)
    for r in results:
        assert "turned the weight into torch.bfloat16 [8, 8]" in r and "fixed at declare for torch.float32 [8, 8]" in r


def finalize_changing_format(ctx):
    block = torch.nn.Module()
    block.proj = ReplicatedLinear(8, 8, bias=False, quant_method=_ChangesFormat(), prefix="proj")
    ws = WeightSharding(ctx.comm, [block], {0: ["proj"]})
    try:
        ws.finalize()
    except ShardingError as e:
        return str(e)
    return "finalized"
