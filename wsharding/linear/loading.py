"""Small loading helpers shared by the v1 loaders (in the linears) and the v2 parameter classes (the
dtype rule and its error live with the row loaders, :mod:`wsharding.core.rowloaders`, which use them too),
and the one check of the values of every quantization scale a checkpoint holds
(:func:`check_scale_values`, [Note: checkpoint scales are finite])."""

from __future__ import annotations

import math

import torch

from wsharding.core.errors import InvalidArgument, WshardingError
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


# [Note: checkpoint scales are finite]
# A quantized weight means q * s, so a scale that is NaN or inf makes every weight it covers NaN or
# +-inf -- and the after-loading steps hide it. Block FP8's UE8M0 requant rounds each scale up to a
# power of two through its exponent, which NaN and inf do not have: the scale comes out as 1.0, the
# block's codes NaN (or +-448 for an inf). A ModelOpt merged linear requantizes every logical shard to
# the largest scale, and the max of a NaN is NaN: one NaN k scale makes every q, k and v code NaN.
# Neither says a word; only a step's output shows it, far from the tensor at fault. So every scale is
# checked where the checkpoint is read (load_checkpoint), before a loader copies it and before any
# code or requant uses it: one isfinite and one comparison over a tensor of a few hundred values.
# The sign: a scale is amax / qmax, never negative. No quantizer writes one, and the UE8M0 requant
# would drop its sign without a word (pow2_ceil(-0.3) is 0.5), so a negative scale is refused in every
# format. Zero differs by format. A block or channel scale of 0 is a block of zero weights (q * 0 is
# 0, and the requant keeps it 0) -- a quantizer that does not clamp amax writes it for an all-zero
# block -- so it loads. A per-tensor scale (ModelOpt's weight_scale and input_scale, int4's
# weight_scale) of 0 is refused: an input_scale of 0 divides the activations by zero (a zero activation
# becomes NaN, every other product 0, whatever the input), and a weight_scale of 0 says a whole
# projection is zero, which a quantizer writes only for a weight it read empty: a damaged export.
def check_scale_values(values: torch.Tensor, name: str, *, zero_allowed: bool, dtype: torch.dtype | None = None,
                       error: type[WshardingError] = InvalidArgument, codes: torch.dtype | None = None,
                       into: torch.dtype = torch.float32) -> None:
    """Refuse a quantization scale ``values`` (checkpoint tensor ``name``) that holds NaN, +-inf, a
    negative value, or 0 where ``zero_allowed`` is False, naming the index of the first such value
    (row-major) and how many more there are ([Note: checkpoint scales are finite]).

    ``dtype``: the parameter's dtype, when the loader converts the tensor to it: the converted values
    are checked, since they are what the model computes with (a float64 1e300 is inf in float32).
    ``error``: the class raised (:func:`wsharding.checkpoint.load_checkpoint` passes ``CheckpointError``).

    ``codes``: the FP8 dtype of the values the scale multiplies (the layer's weight), ``into``: the
    dtype the products are computed in. A finite scale whose largest product -- the code's largest
    value times the scale rounded up to a power of two, as the UE8M0 requant may round it -- is not
    finite in ``into`` is refused like an infinite one: applied, it makes the same inf
    ([Note: checkpoint scales are finite]).
    """
    seen = values
    if dtype is not None and dtype.is_floating_point and dtype != values.dtype:
        seen = values.to(dtype)
    if not seen.is_floating_point():
        return  # an integer has no NaN or inf, and none of the package's formats stores integer scales
    if seen.element_size() == 1:
        seen = seen.float()  # FP8 scales (e8m0, e4m3): read as float32, which holds every one of their values
    bad = ~torch.isfinite(seen) | (seen < 0 if zero_allowed else seen <= 0)
    if not bool(bad.any()) and codes is not None and codes.is_floating_point and codes.itemsize == 1:
        # float64 holds every product exactly enough: 2**128 * 448 is far inside its range
        m, e = torch.frexp(seen.double())
        rounded = torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, e - 1, e))
        limit = min(torch.finfo(into).max, torch.finfo(torch.float32).max)
        over = rounded * torch.finfo(codes).max > limit
        if bool(over.any()):
            at = tuple(over.nonzero()[0].tolist())
            index = f"[{', '.join(map(str, at))}]" if at else ""
            count = int(over.sum())
            more = f"; {count - 1} more of its {seen.numel()} values overflow too" if count > 1 else ""
            raise error(
                f"{name}{index} is {_shortest(seen[at])}: finite, but applied to {codes} values (up to "
                f"{torch.finfo(codes).max:g}) it gives more than {into} holds ({limit:.4g}) -- inf, as a non-finite "
                f"scale would{more}. Loaded, it would silently turn the weights it scales into +-inf. Re-export "
                "the checkpoint, and check the quantizer that wrote it")
    if not bool(bad.any()):
        return
    at = tuple(bad.nonzero()[0].tolist())  # nonzero lists indices in row-major order: the first bad value
    index = f"[{', '.join(map(str, at))}]" if at else ""
    said = _shortest(seen[at])
    if -math.inf < float(seen[at]) < 0:
        said += " (negative)"  # -inf says it already
    if seen is not values and values.is_floating_point():
        said += f" as {dtype} ({_shortest(values[at])} in the checkpoint's {values.dtype})"
    count = int(bad.sum())
    more = f"; {count - 1} more of its {seen.numel()} values break the rule too" if count > 1 else ""
    rule = ("a block or channel scale must be finite and >= 0 (0 only for a block of zero weights)" if zero_allowed
            else "a per-tensor scale must be finite and > 0 (an input_scale of 0 divides the activations by zero, "
                 "a weight_scale of 0 zeroes a whole tensor)")
    raise error(
        f"{name}{index} is {said}: {rule}{more}. Loaded, it would silently turn the weights it scales into NaN, "
        "+-inf or other values. Re-export the checkpoint, and check the quantizer that wrote it (a scale is "
        "amax / qmax: NaN or inf in the weights it read, or a weight never written, ends up here)"
    )


def _shortest(x: torch.Tensor) -> str:
    """The shortest decimal that reads back as the value of the one-element ``x`` in its dtype: a
    float32 -0.01 is ``-0.01``, not the ``-0.009999999776482582`` its float64 repr shows."""
    value = float(x)
    if not math.isfinite(value):
        return repr(value)  # nan, inf, -inf
    for digits in range(1, 18):
        text = f"{value:.{digits}g}"
        if float(torch.tensor(float(text), dtype=x.dtype)) == value:
            return text
    return repr(value)


__all__ = ["CheckpointShapeError", "check_dtype", "check_scale_values", "check_shape", "copy_with_check",
           "is_quantized_dtype", "pad_or_narrow", "param_name"]
