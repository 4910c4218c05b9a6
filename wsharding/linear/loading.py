"""Small loading helpers shared by the v1 loaders (in the linears) and the v2 parameter classes (the
dtype rule and its error live with the row loaders, :mod:`wsharding.core.rowloaders`, which use them too)."""

from __future__ import annotations

import torch

from wsharding.core.errors import InvalidArgument
from wsharding.core.rowloaders import CheckpointShapeError, check_dtype, is_quantized_dtype, param_name


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


__all__ = ["CheckpointShapeError", "check_dtype", "check_shape", "copy_with_check", "is_quantized_dtype", "pad_or_narrow",
           "param_name"]
