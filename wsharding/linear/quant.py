"""Quant methods: who creates a linear's parameters and who issues its GEMM.

A linear never allocates its own weight. It hands sizes to ``quant_method.create_weights`` (both the
per-rank sizes that shape the parameters and the global sizes the loaders need) and calls
``quant_method.apply(layer, x, bias)`` in forward. ``process_weights_after_loading`` is the one moment
where a method may change layout or dtype, after every checkpoint tensor arrived.

``apply`` reads ``layer.weight`` (and scales) *at call time* and never caches them: weight sharding
binds ``layer.weight`` once, at finalize, to a view of the layer's slot
(:func:`wsharding.core.contract.rebind_tensor`), and every step's gather refills that slot before the
layer runs; between two runs of the layer the slot holds other layers' bytes, so anything derived from
the weight and kept would be another layer's.

Besides the unquantised method, three small weight-only formats exercise every v2 parameter class with
real arithmetic (dequantise, then GEMM): int8 per-channel, int8 with block scales, int4 packed eight to
an int32 along the output dim with one per-tensor scale per logical shard. Their ``quantize_*``
functions produce the checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from wsharding.core.errors import InvalidArgument, Unsupported, WshardingError
from wsharding.core.units import ceil_div
from wsharding.linear.parameters import (
    BlockQuantScaleParameter,
    ChannelQuantScaleParameter,
    ModelWeightParameter,
    PackedParameter,
    PerTensorScaleParameter,
)


class QuantError(WshardingError, ValueError):
    """A quantized weight or scale that does not fit its quant method: names the layer and the rule."""


class LinearMethodBase:
    """The three things a quant method does: create parameters, compute, tidy up after loading.

    Two more attributes tell weight sharding how to treat the method's ``weight``:

    * ``weight_shard_mode``: ``"rows"`` -- each rank loads only its 1/N rows, and
      ``process_weights_after_loading`` runs at finalize on the gathered full weight (it must keep the
      weight's shape and dtype); ``"requant_then_shard"`` -- the weight is loaded at full shape,
      processed, and only then sharded (the load peak is not reduced); ``None`` -- cannot be sharded,
      ``weight_shard_refusal`` says why.
    * the sharded parameter is always ``weight``; every other parameter (scales) stays replicated.
    """

    #: v2 methods give ``weight_loader_v2`` to their parameters; v1 ones give ``weight_loader``.
    uses_weight_loader_v2: bool = True
    weight_shard_mode: str | None = "rows"
    weight_shard_refusal: str = ""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype,
                       weight_loader: Callable[..., None]) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """This rank's weight as ``[out_per_partition, in_per_partition]`` floats (for tests and figures)."""
        raise NotImplementedError

    def quantize(self, layer: nn.Module, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters of ``layer`` (as this method creates them, merged shards stacked) that
        represent the float weight ``w`` ``[out_per_partition, in]``: how toy models and tests make
        quantized weights and checkpoints."""
        raise Unsupported(f"{type(self).__name__} cannot quantize a float weight")


def register_param(layer: nn.Module, name: str, param: torch.Tensor) -> None:
    """Register ``param`` on ``layer`` as ``name`` and give it its ``<prefix>.<name>`` for error messages."""
    param.param_name = f"{layer.prefix}.{name}" if getattr(layer, "prefix", "") else name
    layer.register_parameter(name, param)


class UnquantizedLinearMethod(LinearMethodBase):
    """A plain ``weight`` ``[out_per_partition, in_per_partition]`` in ``params_dtype``; ``F.linear``."""

    def __init__(self, use_v2: bool = False) -> None:
        self.uses_weight_loader_v2 = use_v2

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        data = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        register_param(layer, "weight", ModelWeightParameter(data, weight_loader))

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)

    def apply_into(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``x @ W.T (+ bias)`` into the caller-owned ``out`` (static buffers, e.g. graph capture)."""
        torch.matmul(x, layer.weight.t(), out=out)
        if bias is not None:
            out.add_(bias)
        return out

    def dequantized_weight(self, layer):
        return layer.weight

    def quantize(self, layer, w):
        return {"weight": w.to(layer.params_dtype)}


# ------------------------------------------------------------------------------------------------
# int8 per-channel: ModelWeightParameter + ChannelQuantScaleParameter
# ------------------------------------------------------------------------------------------------
def quantize_per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint tensors ``(weight int8 [out, in], weight_scale [out])`` with ``w ~ weight * scale``."""
    scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.float()


class Int8PerChannelLinearMethod(LinearMethodBase):
    """Weight-only int8 with one scale per output channel."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        rows = sum(output_partition_sizes)
        register_param(layer, "weight", ModelWeightParameter(
            torch.empty(rows, input_size_per_partition, dtype=torch.int8), weight_loader))
        register_param(layer, "weight_scale", ChannelQuantScaleParameter(torch.empty(rows, dtype=torch.float32), weight_loader))

    def dequantized_weight(self, layer):
        return layer.weight.float() * layer.weight_scale[:, None]

    def quantize(self, layer, w):
        q, s = quantize_per_channel_int8(w.float())
        return {"weight": q, "weight_scale": s}

    def apply(self, layer, x, bias=None):
        return F.linear(x, self.dequantized_weight(layer).to(x.dtype), bias)


# ------------------------------------------------------------------------------------------------
# int8 with block scales: ModelWeightParameter + BlockQuantScaleParameter
# ------------------------------------------------------------------------------------------------
def quantize_block_int8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint tensors ``(weight int8 [out, in], scale [ceil(out/bn), ceil(in/bk)])``."""
    bn, bk = block
    out, inp = w.shape
    scale = torch.empty(ceil_div(out, bn), ceil_div(inp, bk))
    q = torch.empty_like(w, dtype=torch.int8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = blk.abs().amax().clamp_min(1e-8) / 127.0
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = torch.round(blk / s).clamp(-127, 127).to(torch.int8)
    return q, scale


class BlockInt8LinearMethod(LinearMethodBase):
    """Weight-only int8 with one scale per ``block = (block_n, block_k)`` weights."""

    def __init__(self, block: tuple[int, int] = (128, 128)) -> None:
        self.block = tuple(block)

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        bn, bk = self.block
        tp = getattr(layer, "tp_size", 1)
        for i, size in enumerate(output_partition_sizes):
            # A block straddling two shards or two ranks would need two scales at once.
            if size % bn and (tp > 1 or len(output_partition_sizes) > 1):
                raise InvalidArgument(f"{layer.prefix or type(layer).__name__}: output partition {i} has {size} rows, not a "
                                 f"multiple of block_n {bn}: a scale block would straddle shards or ranks")
        if input_size_per_partition % bk and input_size_per_partition != input_size:
            raise InvalidArgument(f"{layer.prefix or type(layer).__name__}: input partition {input_size_per_partition} is "
                             f"not a multiple of block_k {bk}")
        rows = sum(output_partition_sizes)
        register_param(layer, "weight", ModelWeightParameter(
            torch.empty(rows, input_size_per_partition, dtype=torch.int8), weight_loader))
        register_param(layer, "weight_scale_inv", BlockQuantScaleParameter(
            torch.empty(ceil_div(rows, bn), ceil_div(input_size_per_partition, bk)), weight_loader, block=self.block))

    def dequantized_weight(self, layer):
        bn, bk = self.block
        s = layer.weight_scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        return layer.weight.float() * s[: layer.weight.shape[0], : layer.weight.shape[1]]

    def apply(self, layer, x, bias=None):
        return F.linear(x, self.dequantized_weight(layer).to(x.dtype), bias)


# ------------------------------------------------------------------------------------------------
# int4 packed along the output dim: PackedParameter + PerTensorScaleParameter
# ------------------------------------------------------------------------------------------------
INT4_PACK = 8


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack int4 values (``int8`` in [-8, 7], ``[out, in]``) 8 rows to one ``int32`` row: ``[out/8, in]``."""
    if q.shape[0] % INT4_PACK:
        raise InvalidArgument(f"{q.shape[0]} rows cannot be packed {INT4_PACK} to an int32")
    u = (q.to(torch.int32) & 0xF).view(q.shape[0] // INT4_PACK, INT4_PACK, q.shape[1])
    out = torch.zeros(u.shape[0], u.shape[2], dtype=torch.int32)
    for k in range(INT4_PACK):
        out |= u[:, k] << (4 * k)
    return out


def unpack_int4_rows(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_rows`: ``[out/8, in] int32`` -> ``[out, in] int8``."""
    parts = [((p >> (4 * k)) & 0xF) for k in range(INT4_PACK)]
    u = torch.stack(parts, dim=1).reshape(p.shape[0] * INT4_PACK, p.shape[1])
    return torch.where(u >= 8, u - 16, u).to(torch.int8)


def quantize_int4_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint tensors ``(qweight int32 [out/8, in], weight_scale [1])``."""
    s = w.abs().amax().clamp_min(1e-8) / 7.0
    return pack_int4_rows(torch.round(w / s).clamp(-8, 7).to(torch.int8)), s.reshape(1).float()


class PackedInt4LinearMethod(LinearMethodBase):
    """int4 packed 8 per int32 along the output dim; one scale per logical shard (gate/up, q/k/v)."""

    weight_shard_mode = None
    weight_shard_refusal = ("its weight is `qweight`, eight int4 rows packed in one int32 row, so a rank's 1/N "
                            "rows are not whole stored rows of the checkpoint")

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        rows = sum(output_partition_sizes)
        for i, size in enumerate(output_partition_sizes):
            if size % INT4_PACK:
                raise InvalidArgument(f"{layer.prefix or type(layer).__name__}: output partition {i} has {size} rows, not "
                                 f"a multiple of the pack factor {INT4_PACK}")
        register_param(layer, "qweight", PackedParameter(
            torch.empty(rows // INT4_PACK, input_size_per_partition, dtype=torch.int32), weight_loader,
            packed_dim=0, pack_factor=INT4_PACK))
        register_param(layer, "weight_scale", PerTensorScaleParameter(
            torch.empty(len(output_partition_sizes)), weight_loader))

    def dequantized_weight(self, layer):
        q = unpack_int4_rows(layer.qweight).float()
        sizes = list(layer.output_partition_sizes)
        scale = torch.repeat_interleave(layer.weight_scale, torch.tensor(sizes))
        return q * scale[:, None]

    def apply(self, layer, x, bias=None):
        return F.linear(x, self.dequantized_weight(layer).to(x.dtype), bias)
