"""Column-parallel linears: the weight is split along its output dim (rows of ``[out, in]``).

Each rank holds ``output_size / tp`` rows, computes ``x @ W_r.T`` from the full input with no
communication, and owns a slice of the output; ``gather_output=True`` concatenates the slices with one
all-gather on the column group. :class:`MergedColumnParallelLinear` stacks several column linears (gate
and up) in one parameter so that one GEMM computes them all; each sub-tensor is split on its own.
"""

from __future__ import annotations

import torch

from wsharding.core.errors import InvalidArgument
from wsharding.core.units import ceil_div
from wsharding.linear.base import LinearBase
from wsharding.linear.groups import (
    GroupError,
    ParallelGroupSpec,
    ParallelState,
    divide,
    group_rank_size,
    resolve_linear_group,
)
from wsharding.linear.loading import check_shape, copy_with_check, pad_or_narrow
from wsharding.linear.parameters import v1_rows
from wsharding.linear.quant import LinearMethodBase

#: ``(shard_id, param_row_offset, rows_in_param, checkpoint_row_offset)``, in logical weight rows.
RowSubBlock = tuple[object, int, int, int]




class ColumnParallelLinear(LinearBase):
    """``Y_r = X A_r``: rows ``[tp_rank * out/tp, (tp_rank + 1) * out/tp)`` of the weight on each rank.

    ``parallel_group``: ``None``/``"tp"``, ``"attn_tp"``, ``"shared_experts_tp"``, ``"replicated"``, a
    :class:`~wsharding.linear.groups.ReplicatedParallelGroup` or a resolved group. ``allow_padding``
    gives every rank ``ceil(out/tp)`` rows when tp does not divide ``out`` (zero rows fill the end).
    ``use_presharded_weights``: the checkpoint already holds exactly this rank's rows.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: torch.dtype = torch.float32,
                 quant_method: LinearMethodBase | None = None, prefix: str = "",
                 parallel_group: ParallelGroupSpec = None, parallel_state: ParallelState | None = None,
                 use_presharded_weights: bool = False, allow_padding: bool = False) -> None:
        tp_group = resolve_linear_group(parallel_group, parallel_state)
        _, tp = group_rank_size(tp_group)
        per_rank = ceil_div(output_size, tp) if allow_padding else divide(output_size, tp, f"{prefix or 'column'} output_size")
        self._init_column(input_size, output_size, [per_rank], tp_group, parallel_group, parallel_state, bias,
                          gather_output, skip_bias_add, params_dtype, quant_method, prefix, use_presharded_weights)

    def _init_column(self, input_size, output_size, partition_sizes, tp_group, parallel_group, parallel_state, bias,
                     gather_output, skip_bias_add, params_dtype, quant_method, prefix, use_presharded_weights):
        # Set before LinearBase creates weights: loaders are bound then and read these flags later.
        self.gather_output = gather_output
        self.use_presharded_weights = use_presharded_weights
        LinearBase.__init__(self, input_size, output_size, tp_group=tp_group, parallel_group=parallel_group,
                            parallel_state=parallel_state, input_size_per_partition=input_size,
                            output_partition_sizes=partition_sizes, bias=bias, bias_split=True,
                            skip_bias_add=skip_bias_add, params_dtype=params_dtype, quant_method=quant_method,
                            prefix=prefix)

    # ---- loading ---------------------------------------------------------------------------------
    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        """v1: slice this rank's rows out of the full checkpoint tensor here, then copy."""
        self._load_split(param, loaded_weight, "output_dim", self.output_size)

    def weight_loader_v2(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        """v2: the parameter slices itself; the linear only says which rank it is."""
        param.load_column_parallel_weight(loaded_weight, tp_rank=self.tp_rank, full=self.output_size,
                                          presharded=self.use_presharded_weights)

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's output slice, or the whole output with ``gather_output`` (one all-gather)."""
        bias = None if self.skip_bias_add else self.bias
        out = self.quant_method.apply(self, x, bias)
        if self.gather_output and self.tp_size > 1:
            out = self.tp_group.all_gather(out, dim=-1)[..., : self.output_size]  # drop padding rows
        return (out, self.bias) if self.skip_bias_add else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column linears stacked on the output dim (``output_sizes``, e.g. ``[inter, inter]`` for
    gate/up). Checkpoint sub-tensors are loaded by integer shard id; each is split on its own, so this
    rank's parameter is ``[gate_r; up_r]``, not rows ``r/tp`` of ``[gate; up]``.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True, *, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype: torch.dtype = torch.float32,
                 quant_method: LinearMethodBase | None = None, prefix: str = "",
                 parallel_group: ParallelGroupSpec = None, parallel_state: ParallelState | None = None,
                 use_presharded_weights: bool = False) -> None:
        if not output_sizes:
            raise GroupError(f"{prefix or 'MergedColumnParallelLinear'}: output_sizes must not be empty")
        self.output_sizes = list(output_sizes)
        tp_group = resolve_linear_group(parallel_group, parallel_state)
        _, tp = group_rank_size(tp_group)
        parts = [divide(s, tp, f"{prefix or 'merged'} output_sizes[{i}]") for i, s in enumerate(output_sizes)]
        if gather_output and len(parts) > 1 and tp > 1:
            # A plain gather would interleave [gate_0 up_0 gate_1 up_1 ...]: refuse rather than mislead.
            raise GroupError(f"{prefix or 'MergedColumnParallelLinear'}: gather_output would interleave the merged "
                             "sub-tensors across ranks; gather each sub-tensor after splitting instead")
        self._init_column(input_size, sum(output_sizes), parts, tp_group, parallel_group, parallel_state, bias,
                          gather_output, skip_bias_add, params_dtype, quant_method, prefix, use_presharded_weights)

    def row_sub_blocks(self) -> list[RowSubBlock]:
        """For this rank: ``(shard_id, param_row_offset, rows_in_param, checkpoint_row_offset)`` per sub-tensor.

        Rows ``[param_row_offset, +rows_in_param)`` of the merged parameter come from rows
        ``[checkpoint_row_offset, +rows_in_param)`` of checkpoint sub-tensor ``shard_id`` (logical rows:
        a packed parameter divides all three by its pack factor). Presharded checkpoints start at 0.
        """
        blocks, offset = [], 0
        for i, rows in enumerate(self.output_partition_sizes):
            blocks.append((i, offset, rows, 0 if self.use_presharded_weights else self.tp_rank * rows))
            offset += rows
        return blocks

    def _shard_block(self, shard_id: object) -> RowSubBlock:
        blocks = self.row_sub_blocks()
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(blocks):
            raise InvalidArgument(f"{self.prefix or 'MergedColumnParallelLinear'}: loaded_shard_id must be an int in "
                             f"[0, {len(blocks)}) or None for a fused checkpoint tensor, got {shard_id!r}")
        return blocks[shard_id]

    def _checkpoint_rows(self, i: int) -> int:
        """Rows of sub-tensor ``i`` in the checkpoint: global, or per rank when presharded (the second place
        presharding must be known: offsets into a fused tensor)."""
        return self.output_partition_sizes[i] if self.use_presharded_weights else self.output_sizes[i]

    def _split_fused(self, param: torch.Tensor, loaded: torch.Tensor, rows: callable, load: callable) -> None:
        dim = param.output_dim
        sizes = [rows(param, dim, self._checkpoint_rows(i)) for i in range(len(self.output_sizes))]
        expected = list(param.shape)
        expected[dim] = sum(sizes)
        check_shape(param, loaded, expected, "fused checkpoint tensor")
        offset = 0
        for i, s in enumerate(sizes):
            load(param, loaded.narrow(dim, offset, s), i)
            offset += s

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        """v1: locate sub-tensor ``loaded_shard_id`` in the parameter, take this rank's rows of it, copy."""
        dim = getattr(param, "output_dim", None)
        if loaded_shard_id is None:
            if dim is None:
                return self._load_whole(param, loaded_weight)
            return self._split_fused(param, loaded_weight, v1_rows, self.weight_loader)
        shard_id, p_off, rows, _ = self._shard_block(loaded_shard_id)
        if dim is None:  # one scale per sub-tensor
            check_shape(param, loaded_weight.reshape(-1), (1,), f"shard {shard_id}")
            param.data[shard_id] = loaded_weight.reshape(())
            return
        p_off, rows = v1_rows(param, dim, p_off), v1_rows(param, dim, rows)
        expected = list(param.shape)
        expected[dim] = v1_rows(param, dim, self._checkpoint_rows(shard_id))
        check_shape(param, loaded_weight, expected, f"shard {shard_id}")
        dst = param.data.narrow(dim, p_off, rows)
        if not self.use_presharded_weights:
            loaded_weight = pad_or_narrow(loaded_weight, dim, self.tp_rank * rows, rows)
        copy_with_check(dst, loaded_weight, param, f"shard {shard_id}")

    def weight_loader_v2(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        """v2: tell the parameter which logical rows of which sub-tensor are this rank's."""
        if loaded_shard_id is None:
            if getattr(param, "output_dim", None) is None:
                return self._load_whole(param, loaded_weight)
            return self._split_fused(param, loaded_weight, lambda p, d, n: p.physical(d, n), self.weight_loader_v2)
        shard_id, p_off, rows, _ = self._shard_block(loaded_shard_id)
        param.load_merged_column_weight(loaded_weight, shard_index=shard_id, shard_offset=p_off, shard_size=rows,
                                        block=self.tp_rank, full=self.output_sizes[shard_id],
                                        presharded=self.use_presharded_weights)
