"""FP8 quant methods: ModelOpt-style per-tensor FP8, and block FP8 with a UE8M0 requant.

SGLang's weight sharding for Kimi K3 names two FP8 variants with different loading paths ("量化变体"):

* **ModelOpt FP8 per-tensor** (:class:`Fp8PerTensorLinearMethod`): ``weight`` is ``float8_e4m3fn``
  ``[out, in]``, with one ``weight_scale`` and one static ``input_scale`` per logical shard (q/k/v,
  gate/up). The FP8 weight bytes go into the flat layout; the scales stay replicated, outside it. Its
  after-loading step is *row-local* (each logical shard's rows are requantized to the largest scale),
  so a rank loads only its 1/N rows, as for BF16.
* **Block FP8** (:class:`BlockFp8LinearMethod`, 128 x 128 blocks, ``weight_scale_inv`` one scale per
  block): after loading, every block scale is rounded *up* to a power of two (UE8M0, the format of
  scale-exponent kernels) and the block's weights are re-rounded to e4m3 with the new scale. The design
  runs that requant on the whole weight, so this variant keeps full shape until finalize
  ("requant-then-shard"): **its load peak is not reduced, only its resident bytes**.

[Note: FP8 arithmetic] Every rounding here is defined, so that two ranks -- or a rank and the
replicated model -- produce the same bytes: dequantize in float32 (``q.float() * s``: one IEEE
float32 multiply), divide by a power of two (exact), round to e4m3 (round to nearest, ties to even,
saturated at +-448: torch's cast, after a clamp). Outputs then agree bit for bit because both sides
compute on the same bytes with the same kernel.

The GEMM: ``torch._scaled_mm`` on CUDA devices with FP8 tensor cores (compute capability >= 8.9,
e.g. H100/H200) when K and N are multiples of 16; elsewhere the reference, which dequantizes and
multiplies in float32. Which one a layer uses depends only on its device and shape, so every rank
and every step picks the same (nothing is decided per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wsharding.core.units import ceil_div
from wsharding.linear.parameters import BlockQuantScaleParameter, ModelWeightParameter, PerTensorScaleParameter
from wsharding.linear.quant import LinearMethodBase, QuantError, register_param

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
#: Rows requantized at a time: keeps the float32 temporaries of a requant small.
REQUANT_ROWS = 128


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to e4m3 (nearest, ties to even), saturating at +-448 rather than producing NaN."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2 s)`` exactly, elementwise (``s > 0``): a power of two stays as it is.

    Uses the exponent of ``s`` (frexp), not ``log2``, which may be inexact near powers of two.
    """
    m, e = torch.frexp(s.float())
    e = torch.where(m == 0.5, e - 1, e)  # s == 2**(e-1) exactly: already a power of two
    return torch.ldexp(torch.ones_like(m), e)


def ue8m0_codes(s: torch.Tensor) -> torch.Tensor:
    """The UE8M0 byte of each power-of-two scale: its biased exponent ``log2(s) + 127``.

    Raises when a scale is not a power of two (UE8M0 has no mantissa bits).
    """
    m, e = torch.frexp(s.float())
    if not bool((m == 0.5).all()):
        raise QuantError("ue8m0_codes: every scale must be a power of two (requantize with requant_ue8m0 first)")
    return (e - 1 + 127).to(torch.uint8)


# ---- producing checkpoint tensors ----------------------------------------------------------------
def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt checkpoint tensors ``(weight e4m3 [out, in], weight_scale float32 [])``, ``w ~ q * s``."""
    s = (w.float().abs().amax().clamp_min(1e-12) / FP8_MAX).float()
    return to_e4m3(w.float() / s), s.reshape(())


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 checkpoint tensors ``(weight e4m3 [out, in], weight_scale_inv [ceil(out/bn), ceil(in/bk)])``:
    one float32 scale per block (``amax / 448``; edge blocks cover what is left)."""
    bn, bk = block
    out, inp = w.shape
    scale = torch.empty(ceil_div(out, bn), ceil_div(inp, bk), dtype=torch.float32)
    q = torch.empty(out, inp, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = blk.abs().amax().clamp_min(1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = to_e4m3(blk / s)
    return q, scale


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int] | torch.Size) -> torch.Tensor:
    """A per-block scale grid expanded to one value per weight of ``shape``."""
    bn, bk = block
    return scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def requant_ue8m0(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Requantize block-FP8 ``weight`` in place so every block scale is a power of two; returns the
    new scales (``2 ** ceil(log2 s)``).

    Per block: ``q' = e4m3(float32(q * s) / s')``. ``s' >= s``, so no value grows and none saturates.
    Works ``REQUANT_ROWS`` rows at a time (a multiple of the block height) so the float32 copy of the
    weight never exists whole.
    """
    bn, _ = block
    new = pow2_ceil(scale_inv)
    step = max(bn, (REQUANT_ROWS // bn) * bn)
    for r0 in range(0, weight.shape[0], step):
        r1 = min(r0 + step, weight.shape[0])
        rows = weight[r0:r1]
        s_old = expand_blocks(scale_inv[r0 // bn: ceil_div(r1, bn)], block, (r1 - r0, weight.shape[1]))
        s_new = expand_blocks(new[r0 // bn: ceil_div(r1, bn)], block, (r1 - r0, weight.shape[1]))
        rows.copy_(to_e4m3((rows.float() * s_old) / s_new))
    return new


def requant_per_tensor_rows(weight: torch.Tensor, row_sizes: list[int], scales: torch.Tensor,
                            target: torch.Tensor) -> None:
    """ModelOpt merged weights: requantize each logical shard's rows from its scale to ``target``
    (the largest), in place: ``q' = e4m3(float32(q * s_i) / s_max)``."""
    offset = 0
    for i, n in enumerate(row_sizes):
        s = scales[i]
        for r0 in range(offset, offset + n, REQUANT_ROWS):
            rows = weight[r0:min(r0 + REQUANT_ROWS, offset + n)]
            if bool(s != target):
                rows.copy_(to_e4m3((rows.float() * s) / target))
        offset += n


# ---- the GEMM ------------------------------------------------------------------------------------
def scaled_mm_supported(device: torch.device) -> bool:
    """True on CUDA devices with FP8 tensor cores (compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemm_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """``"scaled_mm"`` or ``"reference"``: from the device and the shape only (same on every rank)."""
    k, n = weight.shape[1], weight.shape[0]
    if scaled_mm_supported(x.device) and k % 16 == 0 and n % 16 == 0:
        return "scaled_mm"
    return "reference"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = (q(x) s_in) (W s_w)^T + b`` with a static per-tensor activation scale.

    ``q(x) = e4m3(x / s_in)``. On FP8 GPUs ``torch._scaled_mm`` (A row-major, B = ``W^T`` column-major);
    elsewhere the reference: the same FP8 operands dequantized and multiplied in float32.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq = to_e4m3(x2.float() / input_scale)
    if fp8_gemm_path(x2, weight) == "scaled_mm":
        out = torch._scaled_mm(xq, weight.t(), scale_a=input_scale.float().reshape(()),
                               scale_b=weight_scale.float().reshape(()), out_dtype=x.dtype,
                               bias=None if bias is None else bias.to(x.dtype))
    else:
        out = torch.matmul(xq.float(), weight.float().t()) * (input_scale.float() * weight_scale.float())
        if bias is not None:
            out = out + bias.float()
        out = out.to(x.dtype)
    return out.reshape(*shape[:-1], weight.shape[0])


# ---- the methods ---------------------------------------------------------------------------------
def _name(layer: nn.Module) -> str:
    return getattr(layer, "prefix", "") or type(layer).__name__


class Fp8PerTensorLinearMethod(LinearMethodBase):
    """ModelOpt FP8: e4m3 weight, one ``weight_scale`` and one static ``input_scale`` per logical shard.

    After loading, a merged linear's shards are requantized to the largest weight scale (row-local:
    works on a rank's row shard or on the whole weight alike) and the input scales become their max,
    so one ``_scaled_mm`` computes all shards. Weight sharding: the weight is in the layout, rows are
    read 1/N per rank; the scales stay replicated.
    """

    weight_shard_mode = "rows"

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        rows, shards = sum(output_partition_sizes), len(output_partition_sizes)
        register_param(layer, "weight", ModelWeightParameter(
            torch.empty(rows, input_size_per_partition, dtype=FP8), weight_loader))
        register_param(layer, "weight_scale", PerTensorScaleParameter(
            torch.ones(shards, dtype=torch.float32), weight_loader))
        register_param(layer, "input_scale", PerTensorScaleParameter(
            torch.ones(shards, dtype=torch.float32), weight_loader))

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out, scales = [], []
        offset = 0
        for n in layer.output_partition_sizes:
            q, s = quantize_fp8_per_tensor(w[offset:offset + n])
            out.append(q)
            scales.append(s)
            offset += n
        shards = len(layer.output_partition_sizes)
        return {"weight": torch.cat(out), "weight_scale": torch.stack(scales),
                "input_scale": torch.full((shards,), self.default_input_scale, dtype=torch.float32)}

    #: Static activation scale the toy checkpoints use (activations are clamped to +-448 times it).
    default_input_scale = 8.0 / FP8_MAX

    def process_weights_after_loading(self, layer):
        ws, ins = layer.weight_scale, layer.input_scale
        shards = len(layer.output_partition_sizes)
        for pname, p in (("weight_scale", ws), ("input_scale", ins)):
            if p.numel() not in (1, shards) or p.dim() > 1:
                raise QuantError(f"{_name(layer)}.{pname} has shape {tuple(p.shape)}: ModelOpt FP8 expects one "
                                 f"scale per logical shard ({shards}); check the checkpoint's scales")
        if ws.numel() == 1:
            return
        target = ws.max()
        requant_per_tensor_rows(layer.weight.data, list(layer.output_partition_sizes), ws.data, target)
        ws.data = target.reshape(1).clone()
        ins.data = ins.max().reshape(1).clone()

    def dequantized_weight(self, layer):
        self._check_processed(layer)
        return layer.weight.float() * layer.weight_scale.float()

    def _check_processed(self, layer: nn.Module) -> None:
        if layer.weight_scale.numel() != 1:
            raise QuantError(f"{_name(layer)}: {layer.weight_scale.numel()} weight scales (one per shard): call "
                             "process_weights_after_loading() after loading (load_checkpoint and "
                             "WeightSharding.finalize do)")

    def apply(self, layer, x, bias=None):
        self._check_processed(layer)
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias)


class BlockFp8LinearMethod(LinearMethodBase):
    """Block FP8: e4m3 weight, ``weight_scale_inv`` one float32 scale per ``block`` (default 128 x 128).

    After loading: the UE8M0 requant (:func:`requant_ue8m0`) on the whole weight. Weight sharding takes
    it as "requant-then-shard": full shape until finalize, then sharded (``weight_shard_mode``).
    The GEMM dequantizes then multiplies in float32 on every device.
    """

    weight_shard_mode = "requant_then_shard"

    def __init__(self, block: tuple[int, int] = (128, 128)) -> None:
        self.block = tuple(block)

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        bn, bk = self.block
        rows = sum(output_partition_sizes)
        multi = len(output_partition_sizes) > 1 or getattr(layer, "tp_size", 1) > 1
        for i, size in enumerate(output_partition_sizes):
            if multi and size % bn:
                raise QuantError(f"{_name(layer)}: output partition {i} has {size} rows, not a multiple of block_n "
                                 f"{bn}: a scale block would straddle two shards; use a block that divides every "
                                 "partition")
        if input_size_per_partition != input_size and input_size_per_partition % bk:
            raise QuantError(f"{_name(layer)}: input partition {input_size_per_partition} is not a multiple of "
                             f"block_k {bk}")
        register_param(layer, "weight", ModelWeightParameter(
            torch.empty(rows, input_size_per_partition, dtype=FP8), weight_loader))
        register_param(layer, "weight_scale_inv", BlockQuantScaleParameter(
            torch.ones(ceil_div(rows, bn), ceil_div(input_size_per_partition, bk), dtype=torch.float32),
            weight_loader, block=self.block))

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> dict[str, torch.Tensor]:
        qs, ss, offset = [], [], 0
        for n in layer.output_partition_sizes:
            q, s = quantize_fp8_block(w[offset:offset + n], self.block)
            qs.append(q)
            ss.append(s)
            offset += n
        return {"weight": torch.cat(qs), "weight_scale_inv": torch.cat(ss)}

    def expected_scale_shape(self, layer: nn.Module) -> tuple[int, int]:
        bn, bk = self.block
        rows, cols = layer.weight.shape
        return ceil_div(rows, bn), ceil_div(cols, bk)

    def process_weights_after_loading(self, layer):
        want = self.expected_scale_shape(layer)
        if tuple(layer.weight_scale_inv.shape) != want:
            raise QuantError(f"{_name(layer)}.weight_scale_inv has shape {tuple(layer.weight_scale_inv.shape)}, "
                             f"expected {want} for a {tuple(layer.weight.shape)} weight in {self.block} blocks; "
                             "check the checkpoint's block size")
        new = requant_ue8m0(layer.weight.data, layer.weight_scale_inv.data, self.block)
        layer.weight_scale_inv.data.copy_(new)

    def dequantized_weight(self, layer):
        w = layer.weight
        return w.float() * expand_blocks(layer.weight_scale_inv.float(), self.block, w.shape)

    def apply(self, layer, x, bias=None):
        out = F.linear(x.float(), self.dequantized_weight(layer), None if bias is None else bias.float())
        return out.to(x.dtype)


def is_power_of_two(s: torch.Tensor) -> bool:
    """True when every element of ``s`` is an exact power of two."""
    m, _ = torch.frexp(s.float())
    return bool((m == 0.5).all())
