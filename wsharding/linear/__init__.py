"""The parallel contract of an inference Linear (SGLang's Linear layers), in four parts.

* **split** -- :mod:`~wsharding.linear.groups`: which group a linear is split on (``tp``, ``attn_tp``,
  ``shared_experts_tp``, ``replicated``, :class:`ReplicatedParallelGroup`), :class:`LogicalGroup` for
  shapes before any communicator exists, DP-attention rank coordinates;
* **load** -- ``weight_loader`` (v1, the linear slices) and ``weight_loader_v2`` (the
  :mod:`~wsharding.linear.parameters` classes slice themselves), presharded checkpoints, padding;
* **compute** -- :mod:`~wsharding.linear.quant`: the quant method creates the parameters and runs the GEMM;
* **reduce** -- :class:`RowParallelLinear`: reduce_results, skip_all_reduce, the DP-attention group.

:func:`~wsharding.linear.contract.check_contract` runs the contract's five alignment checks on a model.
"""

from wsharding.core.contract import rebind_tensor
from wsharding.linear.base import LinearBase, ReplicatedLinear, process_weights
from wsharding.linear.column import ColumnParallelLinear, MergedColumnParallelLinear
from wsharding.linear.groups import (
    DistGroup,
    GroupError,
    LogicalGroup,
    ParallelState,
    ReplicatedGroup,
    ReplicatedParallelGroup,
    attn_coords,
    derive_attn_tp_size,
    get_parallel,
    group_rank_size,
    parallel_state,
    resolve_linear_group,
)
from wsharding.linear.loading import CheckpointShapeError, pad_or_narrow
from wsharding.linear.methods import METHODS, make_quant_method
from wsharding.linear.qkv import QKVParallelLinear
from wsharding.linear.quant import LinearMethodBase, QuantError, UnquantizedLinearMethod
from wsharding.linear.row import RowParallelLinear, skip_mlp_all_reduce

__all__ = [
    "CheckpointShapeError", "ColumnParallelLinear", "DistGroup", "GroupError", "LinearBase", "LinearMethodBase",
    "LogicalGroup", "METHODS", "MergedColumnParallelLinear", "ParallelState", "QKVParallelLinear", "ReplicatedGroup",
    "QuantError", "ReplicatedLinear", "ReplicatedParallelGroup", "RowParallelLinear", "UnquantizedLinearMethod", "attn_coords",
    "derive_attn_tp_size", "get_parallel", "group_rank_size", "make_quant_method", "pad_or_narrow", "parallel_state",
    "process_weights", "rebind_tensor",
    "resolve_linear_group", "skip_mlp_all_reduce",
]
