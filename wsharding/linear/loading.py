"""Small loading helpers shared by the v1 loaders (in the linears) and the v2 parameter classes."""

from __future__ import annotations

import torch


class CheckpointShapeError(ValueError):
    """A checkpoint tensor does not have the shape a parameter expects."""


def param_name(param: torch.Tensor) -> str:
    """The name a linear gave its parameter (``<prefix>.<attr>``), for error messages."""
    return getattr(param, "param_name", None) or "<unnamed parameter>"


def check_shape(param: torch.Tensor, loaded: torch.Tensor, expected: tuple[int, ...] | torch.Size, what: str = "") -> None:
    """Refuse a checkpoint tensor whose shape is not ``expected``, naming the parameter and both shapes."""
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
        raise ValueError(f"pad_or_narrow needs start >= 0 and size >= 0, got {start}, {size}")
    have = max(0, min(size, total - start))
    piece = loaded.narrow(dim, min(start, total), have)
    if have == size:
        return piece
    shape = list(loaded.shape)
    shape[dim] = size - have
    return torch.cat([piece, loaded.new_zeros(shape)], dim=dim)
