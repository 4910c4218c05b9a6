"""What a sharded weight looks like before finalize: its target record and the loaders that fill it.

Two loading paths, chosen by the quant method's ``weight_shard_mode`` (SGLang's weight sharding for Kimi
K3, "加载" and "量化变体"):

* ``"rows"`` (BF16/FP16, int8, ModelOpt FP8): the weight is shrunk to this rank's 1/N rows at setup
  and a :class:`RowShardLoader` replaces its weight loader: it reads only those rows from the
  checkpoint (a lazy tensor: only the rows' bytes are read from the file).
* ``"requant_then_shard"`` (block FP8): the weight keeps its full shape, the linear's own loader
  fills it (wrapped in a :class:`FullShapeLoader` that records what arrived); finalize requantizes
  the whole weight and only then shards it. The load peak is not reduced, only the resident bytes.

Both loaders are strict -- a checkpoint tensor must have exactly the rows of the (sub-)weight it
fills, a quantized dtype must match -- and both record which rows arrived, so that finalize can
refuse a weight whose rows were never all loaded instead of sharding uninitialised memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from wsharding.core.errors import ShardingError, WshardingError

#: (shard_id, param_row_offset, rows_in_param, checkpoint_row_offset)
RowBlock = tuple[Any, int, int, int]


class CheckpointShapeError(WshardingError, ValueError):
    """A checkpoint tensor does not have the shape a parameter expects."""


def param_name(param: torch.Tensor) -> str:
    """The name a linear gave its parameter (``<prefix>.<attr>``), for error messages."""
    return getattr(param, "param_name", None) or "<unnamed parameter>"


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """FP8 and integer dtypes: their bytes mean something only together with their scales."""
    return not dtype.is_floating_point or dtype.itemsize == 1


def check_dtype(param: torch.Tensor, loaded_dtype: torch.dtype, what: str = "", *, name: str | None = None) -> None:
    """Refuse a checkpoint tensor whose dtype does not match a quantized parameter (or a quantized or
    integer tensor loaded into a float parameter): ``copy_`` would silently convert the numbers, not the
    format. Float to float (an FP32 checkpoint into BF16 weights, BF16 into FP32) stays allowed: the
    loaders convert it as ``tensor.to(dtype)`` does. ``name``: the parameter's name where it has no
    ``param_name`` of its own (a plain ``nn.Linear``'s)."""
    if loaded_dtype == param.dtype:
        return
    where = f" ({what})" if what else ""
    name = name or param_name(param)
    if not loaded_dtype.is_floating_point and param.dtype.is_floating_point and not is_quantized_dtype(param.dtype):
        # An int tensor into BF16/F32 weights: copy_ would turn the codes (or indices) into floats of
        # the same value, a model of wrong numbers that loads without a word.
        raise CheckpointShapeError(
            f"checkpoint tensor for {name}{where} is {loaded_dtype}, the parameter is {param.dtype}: "
            "integer values are not converted to float weights (they are quantized codes or indices, meaningless "
            "without their scales) -- load a float checkpoint, or build the model with the quant method the "
            "checkpoint was quantized with"
        )
    if is_quantized_dtype(param.dtype) or is_quantized_dtype(loaded_dtype):
        raise CheckpointShapeError(
            f"checkpoint tensor for {name}{where} is {loaded_dtype}, the parameter is {param.dtype}: "
            "the checkpoint was made for another quant method -- build the model with the quant method the "
            "checkpoint was quantized with"
        )


@dataclass
class ShardTarget:
    """One weight that is stored 1/N per rank and gathered before its layer runs."""

    layer: int
    name: str  # attribute path inside the layer, e.g. "attn.qkv_proj"
    module: nn.Module
    shape: tuple[int, ...]
    dtype: torch.dtype
    row_blocks: list[RowBlock] = field(default_factory=list)
    #: "rows" or "requant_then_shard" (see the module docstring)
    mode: str = "rows"

    @property
    def entry(self) -> str:
        return f"{self.name}.weight"

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def label(self) -> str:
        return f"layer {self.layer} {self.entry}"


def row_window(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a weight that ``rank`` keeps after setup (its 1/N row shard)."""
    per = rows // world
    return rank * per, (rank + 1) * per


def _shape_dtype(loaded: Any) -> tuple[tuple[int, ...], torch.dtype | None]:
    if hasattr(loaded, "get_shape"):
        dtype = loaded.get_dtype() if hasattr(loaded, "get_dtype") else None
        return tuple(loaded.get_shape()), dtype if isinstance(dtype, torch.dtype) else None
    return tuple(loaded.shape), loaded.dtype


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def format_rows(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in ranges)


class _Coverage:
    """Which rows of ``[lo, hi)`` arrived."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.arrived: list[tuple[int, int]] = []

    def add(self, a: int, b: int) -> None:
        if a < b:
            self.arrived = _merge([*self.arrived, (a, b)])

    def mark_all(self) -> None:
        self.arrived = [(self.lo, self.hi)] if self.lo < self.hi else []

    @property
    def loaded_rows(self) -> int:
        return sum(b - a for a, b in self.arrived)

    def missing(self) -> list[tuple[int, int]]:
        gaps, at = [], self.lo
        for a, b in self.arrived:
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        if at < self.hi:
            gaps.append((at, self.hi))
        return gaps


def _blocks_for(t: ShardTarget, shard_id: Any) -> list[RowBlock]:
    """The sub-blocks a checkpoint tensor with ``shard_id`` fills. ``None`` is the whole (or fused)
    weight: for a tp-1 merged linear the fused tensor ``[q; k; v]`` is the parameter row for row."""
    if shard_id is None:
        return [(None, 0, t.rows, 0)]
    blocks = [b for b in t.row_blocks if b[0] == shard_id and b[0] is not None]
    if not blocks:
        ids = [b[0] for b in t.row_blocks if b[0] is not None]
        known = f"known: {ids}, or None for a fused tensor" if ids else "it is not a merged linear: load it with None"
        raise ShardingError(f"{t.entry}: no sub-block with shard id {shard_id!r} ({known})")
    return blocks


def _check_tensor(t: ShardTarget, param: torch.Tensor, loaded: Any, block: RowBlock) -> None:
    shard_id, _, rows, ckpt_off = block
    shape, dtype = _shape_dtype(loaded)
    what = f"shard {shard_id!r}" if shard_id is not None else "whole weight"
    if dtype is not None:
        check_dtype(param, dtype, what, name=t.label)
    want = (ckpt_off + rows, *t.shape[1:])
    if shape != want:
        raise ShardingError(
            f"{t.label} ({what}): checkpoint tensor has shape {list(shape)}, expected exactly {list(want)} -- "
            f"{'more' if len(shape) == len(want) and shape[0] > want[0] else 'other'} rows or columns than the "
            "weight it fills: was the checkpoint written for another model config?"
        )


def _read_rows(loaded: Any, start: int, stop: int, dst: torch.Tensor) -> None:
    """Rows ``[start, stop)`` of ``loaded`` into ``dst``, converted to ``dst``'s dtype when the two are
    different float dtypes (:func:`check_dtype` has refused every other mix by now)."""
    if hasattr(loaded, "read_rows_into"):
        if getattr(loaded, "dtype", dst.dtype) == dst.dtype:
            loaded.read_rows_into(start, stop, dst)  # only these rows' bytes are read from the file
        else:
            # An F16/BF16 checkpoint into F32 weights (or back): the rows are read as stored, then
            # converted by copy_, the kernel tensor.to(dtype) runs -- the same bits as converting the
            # full tensor first. Only these rows are read; the transient is one row range.
            dst.copy_(loaded.read_rows(start, stop))
    else:
        dst.copy_(loaded[start:stop])  # a tensor, or a safetensors slice (reads only the slice)


class CoveredLoader:
    """What both loaders share: the target, the row window they fill, and which rows of it arrived
    (finalize refuses a target with missing rows, naming them)."""

    def __init__(self, target: ShardTarget, window: tuple[int, int]) -> None:
        self.target = target
        self.window = window
        self.coverage = _Coverage(*window)
        #: The digest of the full weight as built, taken at setup before the shrink ([Note: digest
        #: before the shrink] in ``wsharding/core/replicas.py``); None once any rows are loaded
        #: over it, or when the weight was not kept.
        self.digest: int | None = None

    @property
    def loaded_rows(self) -> int:
        return self.coverage.loaded_rows

    def missing_rows(self) -> list[tuple[int, int]]:
        return self.coverage.missing()


class RowShardLoader(CoveredLoader):
    """Weight loader installed on a sharded parameter: copies only this rank's rows.

    ``loaded_weight`` may be a tensor or a lazy tensor (``get_shape`` + ``read_rows_into``, or a
    safetensors slice): only the needed row range is read. For merged linears the checkpoint holds
    one tensor per sub-block (``loaded_shard_id`` picks it, and its rows are intersected with this
    rank's window) or one fused tensor (``None``).
    """

    def __init__(self, target: ShardTarget, rank: int, world: int) -> None:
        super().__init__(target, row_window(target.rows, rank, world))

    def __call__(self, param: torch.Tensor, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
        t = self.target
        w0, w1 = self.window
        self.digest = None  # these rows are no longer the weights as built
        for block in _blocks_for(t, loaded_shard_id):
            _check_tensor(t, param, loaded_weight, block)
            _, param_off, rows, ckpt_off = block
            a, b = max(w0, param_off), min(w1, param_off + rows)
            if a >= b:
                continue  # none of this sub-block's rows live on this rank
            _read_rows(loaded_weight, ckpt_off + a - param_off, ckpt_off + b - param_off, param.data[a - w0 : b - w0])
            self.coverage.add(a, b)


class FullShapeLoader(CoveredLoader):
    """For requant-then-shard targets: delegates to the linear's own loader (full shape) and records
    which rows arrived, with the same strict shape and dtype rules as :class:`RowShardLoader`."""

    def __init__(self, target: ShardTarget, inner: Callable[..., None] | None) -> None:
        super().__init__(target, (0, target.rows))
        self.inner = inner

    def __call__(self, param: torch.Tensor, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
        t = self.target
        self.digest = None  # these rows are no longer the weights as built
        blocks = _blocks_for(t, loaded_shard_id)
        for block in blocks:
            _check_tensor(t, param, loaded_weight, block)
        if hasattr(loaded_weight, "read"):
            loaded_weight = loaded_weight.read()
        if self.inner is None:
            param.data.copy_(loaded_weight)
        elif loaded_shard_id is None:
            self.inner(param, loaded_weight)
        else:
            self.inner(param, loaded_weight, loaded_shard_id)
        for _, param_off, rows, _ in blocks:
            self.coverage.add(param_off, param_off + rows)
