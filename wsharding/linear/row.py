"""RowParallelLinear: the weight is split along its input dim; outputs are partial sums.

``Y = sum_r X_r A_r``: each rank multiplies its slice of the input by its rows of ``A`` and gets a full
``[M, out]`` partial sum. Somebody must add them up -- the reduction contract:

* ``reduce_results=True`` (default): this linear all-reduces, on ``reduce_group``;
* ``reduce_results=False``: the layer boundary owns the sum (*not* "no reduction");
* ``skip_all_reduce=True`` in forward, or :func:`skip_mlp_all_reduce` around it: the caller owns it;
* ``use_dp_attention_reduce=True``: the sum runs on the attention-TP group (one DP replica), never
  across replicas, which hold different requests.

Bias: only TP rank 0 adds it, so that the sum counts it once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from wsharding.core.errors import InvalidArgument, Unsupported
from wsharding.core.units import ceil_div
from wsharding.linear.base import LinearBase
from wsharding.linear.groups import (
    ParallelGroupSpec,
    ParallelState,
    ResolvedGroup,
    divide,
    group_rank_size,
    resolve_linear_group,
)
from wsharding.linear.loading import pad_or_narrow
from wsharding.linear.quant import LinearMethodBase

_SKIP_MLP_ALL_REDUCE = [False]


@contextlib.contextmanager
def skip_mlp_all_reduce() -> Iterator[None]:
    """A forward-time flag (the decoder's ``mlp_reduce_scatter``): row linears run inside it leave their
    partial sums to the caller, without the flag being threaded through every module."""
    _SKIP_MLP_ALL_REDUCE.append(True)
    try:
        yield
    finally:
        _SKIP_MLP_ALL_REDUCE.pop()


def should_skip_mlp_all_reduce() -> bool:
    return _SKIP_MLP_ALL_REDUCE[-1]


class RowParallelLinear(LinearBase):
    """``weight`` ``[out, in/tp]``; ``input_is_parallel=False`` splits a full input here first."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, params_dtype: torch.dtype = torch.float32, reduce_results: bool = True,
                 quant_method: LinearMethodBase | None = None, prefix: str = "",
                 parallel_group: ParallelGroupSpec = None, parallel_state: ParallelState | None = None,
                 use_dp_attention_reduce: bool = False, use_presharded_weights: bool = False,
                 allow_padding: bool = False) -> None:
        tp_group = resolve_linear_group(parallel_group, parallel_state)
        _, tp = group_rank_size(tp_group)
        per_rank = ceil_div(input_size, tp) if allow_padding else divide(input_size, tp, f"{prefix or 'row'} input_size")
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.use_dp_attention_reduce = use_dp_attention_reduce
        self.use_presharded_weights = use_presharded_weights
        #: Set only to build a deliberately misaligned model (the contract's reduction check).
        self.reduce_group_override: ResolvedGroup | None = None
        super().__init__(input_size, output_size, tp_group=tp_group, parallel_group=parallel_group,
                         parallel_state=parallel_state, input_size_per_partition=per_rank,
                         output_partition_sizes=[output_size], bias=bias, bias_split=False,
                         skip_bias_add=skip_bias_add, params_dtype=params_dtype, quant_method=quant_method,
                         prefix=prefix)

    @property
    def reduce_group(self) -> ResolvedGroup | None:
        """Where the partial sums are added: the attention-TP group under DP attention, else the group
        the weight was split on (a ReplicatedGroup reduces on its full group, each partition once)."""
        if self.reduce_group_override is not None:
            return self.reduce_group_override
        if self.use_dp_attention_reduce:
            return self.parallel_state.group_named("attn_tp")
        return self.tp_group

    # ---- loading ---------------------------------------------------------------------------------
    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        """v1: take this rank's columns (input dim) of the checkpoint; unsplit tensors are copied whole."""
        self._load_split(param, loaded_weight, "input_dim", self.input_size)

    def weight_loader_v2(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        param.load_row_parallel_weight(loaded_weight, tp_rank=self.tp_rank, full=self.input_size,
                                       presharded=self.use_presharded_weights)

    # ---- forward ---------------------------------------------------------------------------------
    def will_reduce(self, skip_all_reduce: bool = False) -> bool:
        """Whether forward all-reduces here (the three switches of the reduction contract)."""
        return self.reduce_results and self.tp_size > 1 and not skip_all_reduce and not should_skip_mlp_all_reduce()

    def forward(self, x: torch.Tensor, skip_all_reduce: bool = False,
                output_tensor: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Partial GEMM on this rank's input slice, bias on rank 0 only, then (maybe) the all-reduce.

        ``output_tensor``: write into a caller-owned buffer (static graphs); a quant method without
        ``apply_into`` raises rather than silently allocating.
        """
        per = self.input_size_per_partition
        if self.input_is_parallel:
            if x.shape[-1] != per:
                raise InvalidArgument(f"{self.prefix or 'RowParallelLinear'}: input_is_parallel expects this rank's "
                                 f"{per} input features, got {x.shape[-1]}")
            x_par = x
        else:
            if x.shape[-1] != self.input_size:
                raise InvalidArgument(f"{self.prefix or 'RowParallelLinear'}: expects {self.input_size} input features, "
                                 f"got {x.shape[-1]}")
            x_par = pad_or_narrow(x, x.dim() - 1, self.tp_rank * per, per)
        # Only rank 0 adds the bias: the sum over ranks must count it once.
        bias = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        if output_tensor is None:
            out = self.quant_method.apply(self, x_par, bias)
        else:
            apply_into = getattr(self.quant_method, "apply_into", None)
            if apply_into is None:
                raise Unsupported(f"{type(self.quant_method).__name__} cannot write into a caller-owned linear "
                                   "output: call forward without output_tensor or give the method apply_into")
            out = apply_into(self, x_par, output_tensor, bias)
        if self.will_reduce(skip_all_reduce):
            out = self.reduce_group.all_reduce(out)
        return (out, self.bias) if self.skip_bias_add else out
