"""v2 parameter classes: the parameter object slices the checkpoint itself.

With the v1 loader the linear slices a checkpoint tensor and copies it into a plain parameter. With v2
(``weight_loader_v2``) the linear only works out *which* logical rows belong to this rank and calls a
method of the parameter; the parameter knows its own storage: which dim is split, how values are
packed (``pack_factor`` logical values per stored element), what one scale element covers (a block of
``block`` weights, one channel, one whole shard). A new quantisation format adds a parameter class;
the linears do not change.

Every method takes *logical* coordinates (weight rows / columns as the unquantised model counts them)
and converts them to stored ones with :meth:`BaseParameter.physical`. ``full`` is the checkpoint's
extent along the split dim (global, or per rank when the checkpoint is presharded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from wsharding.core.errors import InvalidType
from wsharding.core.units import ceil_div
from wsharding.linear.loading import CheckpointShapeError, check_shape, copy_with_check, pad_or_narrow

QKV_INDEX = {"q": 0, "k": 1, "v": 2}


class BaseParameter(nn.Parameter):
    """A parameter that loads itself. Without a split dim it takes the checkpoint tensor whole."""

    output_dim: int | None = None
    input_dim: int | None = None

    def __new__(cls, data: torch.Tensor, *args: Any, **kwargs: Any) -> BaseParameter:
        return super().__new__(cls, data=data, requires_grad=False)

    def __init__(self, data: torch.Tensor, weight_loader: Callable[..., None] | None = None, **kwargs: Any) -> None:
        self.weight_loader = weight_loader
        self.param_name = ""
        for k, v in kwargs.items():
            setattr(self, k, v)

    # logical -> stored coordinates -----------------------------------------------------------
    def physical(self, dim: int, n: int) -> int:
        """Stored elements for ``n`` logical ones along ``dim`` (identity for plain weights)."""
        return n

    def _take(self, loaded: torch.Tensor, dim: int, offset: int, size: int, block: int, full: int,
              presharded: bool, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination slice of this parameter, matching slice of the checkpoint) along ``dim``."""
        p_off, p_size, p_full = self.physical(dim, offset), self.physical(dim, size), self.physical(dim, full)
        expected = list(self.shape)
        expected[dim] = p_size if presharded else p_full
        check_shape(self, loaded, expected, what)
        dst = self.data.narrow(dim, p_off, p_size)
        if presharded:  # the checkpoint already holds exactly this rank's rows: no second slicing
            return dst, loaded
        return dst, pad_or_narrow(loaded, dim, block * p_size, p_size)

    # the three load paths --------------------------------------------------------------------
    def load_column_parallel_weight(self, loaded: torch.Tensor, *, tp_rank: int, full: int,
                                    presharded: bool = False) -> None:
        if self.output_dim is None:
            return self._load_whole(loaded)
        dst, src = self._take(loaded, self.output_dim, 0, self.logical(self.output_dim), tp_rank, full, presharded,
                              f"column rank {tp_rank}")
        copy_with_check(dst, src, self)

    def load_merged_column_weight(self, loaded: torch.Tensor, *, shard_index: int, shard_offset: int, shard_size: int,
                                  block: int, full: int, presharded: bool = False) -> None:
        """Fill rows ``[shard_offset, shard_offset + shard_size)`` of this parameter from block ``block`` (of
        ``shard_size`` rows) of one sub-tensor of the checkpoint (gate/up, q/k/v)."""
        if self.output_dim is None:
            return self._load_whole(loaded)
        dst, src = self._take(loaded, self.output_dim, shard_offset, shard_size, block, full, presharded,
                              f"shard {shard_index}, checkpoint block {block}")
        copy_with_check(dst, src, self)

    def load_qkv_weight(self, loaded: torch.Tensor, *, shard_id: str, shard_offset: int, shard_size: int,
                        tp_rank: int, num_replicas: int, full: int, presharded: bool = False) -> None:
        """Q reads block ``tp_rank``; K/V read block ``tp_rank // num_replicas``: replicas read the same rows."""
        block = tp_rank if shard_id == "q" else tp_rank // num_replicas
        self.load_merged_column_weight(loaded, shard_index=QKV_INDEX[shard_id], shard_offset=shard_offset,
                                       shard_size=shard_size, block=block, full=full, presharded=presharded)

    def load_row_parallel_weight(self, loaded: torch.Tensor, *, tp_rank: int, full: int,
                                 presharded: bool = False) -> None:
        if self.input_dim is None:
            return self._load_whole(loaded)
        dst, src = self._take(loaded, self.input_dim, 0, self.logical(self.input_dim), tp_rank, full, presharded,
                              f"row rank {tp_rank}")
        copy_with_check(dst, src, self)

    def logical(self, dim: int) -> int:
        """This parameter's own extent along ``dim`` in logical units."""
        return self.shape[dim]

    def _load_whole(self, loaded: torch.Tensor) -> None:
        if loaded.numel() == self.numel() == 1:
            loaded = loaded.reshape(self.shape)  # a scalar scale may be stored as () or (1,)
        check_shape(self, loaded, self.shape, "not split")
        self.data.copy_(loaded)


class ModelWeightParameter(BaseParameter):
    """A plain weight ``[out, in]``: split on ``output_dim`` by column linears, ``input_dim`` by row linears."""

    def __init__(self, data: torch.Tensor, weight_loader: Callable[..., None] | None = None, *,
                 output_dim: int = 0, input_dim: int | None = 1, **kw: Any) -> None:
        super().__init__(data, weight_loader, output_dim=output_dim, input_dim=input_dim, **kw)


class PackedParameter(ModelWeightParameter):
    """``pack_factor`` logical values stored per element along ``packed_dim`` (e.g. 8 int4 in one int32).

    Offsets and sizes along the packed dim are divided by ``pack_factor`` before slicing; a shard that
    does not start on a pack boundary cannot be loaded (the contract's logical/physical check).
    """

    def __init__(self, data: torch.Tensor, weight_loader: Callable[..., None] | None = None, *,
                 packed_dim: int, pack_factor: int, output_dim: int = 0, input_dim: int | None = 1) -> None:
        super().__init__(data, weight_loader, output_dim=output_dim, input_dim=input_dim)
        self.packed_dim = packed_dim
        self.pack_factor = pack_factor

    def physical(self, dim: int, n: int) -> int:
        if dim != self.packed_dim:
            return n
        if n % self.pack_factor:
            raise CheckpointShapeError(
                f"{self.param_name}: {n} logical rows along packed dim {dim} are not a multiple of pack_factor "
                f"{self.pack_factor}; a rank's shard must start and end on a pack boundary"
            )
        return n // self.pack_factor

    def logical(self, dim: int) -> int:
        return self.shape[dim] * (self.pack_factor if dim == self.packed_dim else 1)


class QuantScale:
    """Marks a parameter class that holds quantization scales: :func:`wsharding.checkpoint.load_checkpoint`
    checks the checkpoint's values with :func:`wsharding.linear.loading.check_scale_values` before the
    loader copies them ([Note: checkpoint scales are finite] in ``wsharding/linear/loading.py``). A quant
    method of one's own marks its scale parameters by mixing this in first."""

    #: Whether 0 is a valid value: True for block and channel scales (a block of zero weights), False
    #: for per-tensor ones.
    zero_allowed: bool = True


class ChannelQuantScaleParameter(QuantScale, BaseParameter):
    """One scale per output channel ``[out]``: split with the rows (column), whole for a row linear."""

    def __init__(self, data: torch.Tensor, weight_loader: Callable[..., None] | None = None, **kw: Any) -> None:
        super().__init__(data, weight_loader, output_dim=0, input_dim=None, **kw)


class PerTensorScaleParameter(QuantScale, BaseParameter):
    """One scale per logical shard (``[1]`` for a plain linear, one per gate/up or q/k/v for merged ones).

    The checkpoint holds one scalar per sub-tensor; the merged loader writes it at ``shard_index``.
    A value of 0 is refused at load ([Note: checkpoint scales are finite]).
    """

    zero_allowed = False

    def load_merged_column_weight(self, loaded: torch.Tensor, *, shard_index: int, shard_offset: int, shard_size: int,
                                  block: int, full: int, presharded: bool = False) -> None:
        if loaded.numel() != 1:
            raise CheckpointShapeError(f"{self.param_name}: a per-tensor scale must hold 1 value, got shape "
                                       f"{tuple(loaded.shape)}")
        self.data[shard_index] = loaded.reshape(())

    def load_column_parallel_weight(self, loaded: torch.Tensor, *, tp_rank: int, full: int,
                                    presharded: bool = False) -> None:
        self.load_merged_column_weight(loaded, shard_index=0, shard_offset=0, shard_size=0, block=0, full=0)

    def load_row_parallel_weight(self, loaded: torch.Tensor, *, tp_rank: int, full: int,
                                 presharded: bool = False) -> None:
        self.load_merged_column_weight(loaded, shard_index=0, shard_offset=0, shard_size=0, block=0, full=0)


class BlockQuantScaleParameter(QuantScale, ModelWeightParameter):
    """One scale per ``block = (block_n, block_k)`` weights: shape ``[ceil(out/bn), ceil(in/bk)]``.

    Weight rows ``[offset, offset + size)`` map to scale rows ``[ceil(offset/bn), ceil(offset/bn) +
    ceil(size/bn))`` -- ceiling division so an edge block is never dropped. ``block_n == 1`` is the
    per-row-exponent formats (ue8m0), where a scale row is a weight row.
    """

    def __init__(self, data: torch.Tensor, weight_loader: Callable[..., None] | None = None, *,
                 block: tuple[int, int]) -> None:
        super().__init__(data, weight_loader, output_dim=0, input_dim=1)
        self.block = tuple(block)

    def physical(self, dim: int, n: int) -> int:
        return ceil_div(n, self.block[0] if dim == self.output_dim else self.block[1])

    def logical(self, dim: int) -> int:
        return self.shape[dim] * (self.block[0] if dim == self.output_dim else self.block[1])


def v1_rows(param: torch.Tensor, dim: int, n: int) -> int:
    """The v1 loaders' own coordinate arithmetic: packed dims divide by ``pack_factor`` (as in SGLang's
    Linear layers); anything fancier (block scales) must go through ``weight_loader_v2``."""
    if isinstance(param, BlockQuantScaleParameter):
        raise InvalidType(f"{getattr(param, 'param_name', 'parameter')} is a BlockQuantScaleParameter: it can only be "
                        "loaded by weight_loader_v2 (give the quant method uses_weight_loader_v2=True)")
    if getattr(param, "packed_dim", None) == dim:
        return n // param.pack_factor
    return n
