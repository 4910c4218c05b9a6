"""Small loading helpers shared by the v1 loaders (in the linears) and the v2 parameter classes."""

from __future__ import annotations

import torch

from wsharding.core.errors import InvalidArgument, WshardingError


class CheckpointShapeError(WshardingError, ValueError):
    """A checkpoint tensor does not have the shape a parameter expects."""


def param_name(param: torch.Tensor) -> str:
    """The name a linear gave its parameter (``<prefix>.<attr>``), for error messages."""
    return getattr(param, "param_name", None) or "<unnamed parameter>"


def is_quantized_dtype(dtype: torch.dtype) -> bool:
    """FP8 and integer dtypes: their bytes mean something only together with their scales."""
    return not dtype.is_floating_point or dtype.itemsize == 1


def check_dtype(param: torch.Tensor, loaded_dtype: torch.dtype, what: str = "") -> None:
    """Refuse a checkpoint tensor whose dtype does not match a quantized parameter (or a quantized
    tensor loaded into a float parameter): ``copy_`` would silently convert the numbers, not the format.
    Float to float (an FP32 checkpoint into BF16 weights) stays allowed."""
    if loaded_dtype == param.dtype:
        return
    if is_quantized_dtype(param.dtype) or is_quantized_dtype(loaded_dtype):
        where = f" ({what})" if what else ""
        raise CheckpointShapeError(
            f"checkpoint tensor for {param_name(param)}{where} is {loaded_dtype}, the parameter is {param.dtype}: "
            "the checkpoint was made for another quant method -- build the model with the quant method the "
            "checkpoint was quantized with"
        )


def check_shape(param: torch.Tensor, loaded: torch.Tensor, expected: tuple[int, ...] | torch.Size, what: str = "") -> None:
    """Refuse a checkpoint tensor whose shape is not ``expected`` (or whose dtype does not fit a quantized
    parameter, :func:`check_dtype`), naming the parameter and both shapes."""
    if isinstance(loaded, torch.Tensor):
        check_dtype(param, loaded.dtype, what)
    if tuple(loaded.shape) != tuple(expected):
        where = f" ({what})" if what else ""
        raise CheckpointShapeError(
            f"checkpoint tensor for {param_name(param)}{where} has shape {tuple(loaded.shape)}, expected "
            f"{tuple(expected)}: check the model config (sizes, heads, tp) against the checkpoint"
        )


def copy_with_check(dst: torch.Tensor, src: torch.Tensor, param: torch.Tensor | None = None, what: str = "") -> None:
    """``dst.copy_(src)`` after checking the shapes match exactly (no broadcasting allowed)."""
    if tuple(dst.shape) != tuple(src.shape):
        name = param_name(param) if param is not None else "<destination>"
        where = f" ({what})" if what else ""
        raise CheckpointShapeError(
            f"slice of the checkpoint for {name}{where} has shape {tuple(src.shape)} but this rank's parameter "
            f"slice is {tuple(dst.shape)}: the loader's group and the parameter's partition disagree"
        )
    dst.copy_(src)


def pad_or_narrow(loaded: torch.Tensor, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows ``[start, start + size)`` of ``loaded`` along ``dim``, zero-padded where the tensor ends.

    The single exit for sizes that the group does not divide: the parameter was built with
    ``ceil(total / tp)`` rows, so the last rank(s) read fewer real rows than they hold, and the rest is
    zeros (zero weight rows / columns add nothing to a GEMM).
    """
    total = loaded.shape[dim]
    if start < 0 or size < 0:
        raise InvalidArgument(f"pad_or_narrow needs start >= 0 and size >= 0, got {start}, {size}")
    have = max(0, min(size, total - start))
    piece = loaded.narrow(dim, min(start, total), have)
    if have == size:
        return piece
    shape = list(loaded.shape)
    shape[dim] = size - have
    return torch.cat([piece, loaded.new_zeros(shape)], dim=dim)
