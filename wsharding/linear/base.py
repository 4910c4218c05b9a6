"""LinearBase: sizes, the bound group, and the quant method that creates the parameters.

Every linear exposes the same surface (weight sharding and the contract checks rely on it):

* ``input_size`` / ``output_size`` (global) and ``input_size_per_partition`` /
  ``output_size_per_partition`` / ``output_partition_sizes`` (this rank);
* ``tp_group`` (resolved group or ``None``), ``tp_rank``, ``tp_size`` -- ``None`` is rank 0 of 1;
* the parameters the quant method created (``weight`` ``[out_per_partition, in_per_partition]`` when
  unquantised) and ``bias`` or ``None``; ``params_dtype``, ``quant_method``;
* ``weight_loader(param, loaded_weight, loaded_shard_id=None)`` (v1: the linear slices) and
  ``weight_loader_v2(...)`` (v2: the parameter slices itself).

The group is bound *before* the quant method creates parameters: a method may read ``layer.tp_size``
to choose shapes, and with the class default (``None``) it would silently build unsplit shapes.
"""

from __future__ import annotations

import torch
from torch import nn

from wsharding.core.contract import ParallelLinear
from wsharding.linear.groups import ParallelState, ResolvedGroup, get_parallel, group_rank_size
from wsharding.linear.loading import check_shape, copy_with_check, pad_or_narrow
from wsharding.linear.parameters import BaseParameter, v1_rows
from wsharding.linear.quant import LinearMethodBase, UnquantizedLinearMethod


def process_weights(model: nn.Module) -> int:
    """Run ``process_weights_after_loading`` on every linear of ``model`` that still needs it,
    except weight-sharding targets (their finalize runs it on the gathered full weight).

    Call it once every weight has arrived (:func:`wsharding.checkpoint.load_checkpoint` does).
    Returns how many linears were processed now."""
    n = 0
    for m in model.modules():
        if isinstance(m, LinearBase) and getattr(m, "weight_shard_target", None) is None and not m.weights_processed:
            m.process_weights_after_loading()
            n += 1
    return n


class LinearBase(ParallelLinear):
    """Common state of every linear; subclasses decide the partition and the loaders."""

    #: Class default: an unbound layer is "not split" (rank 0 of 1) rather than an AttributeError.
    tp_group: ResolvedGroup | None = None
    #: A per-layer quantisation scheme (a plain object, never an nn.Module: a Module would be hidden in
    #: ``_modules`` and this class attribute would keep answering None).
    scheme = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp_group: ResolvedGroup | None,
        parallel_group: object,
        parallel_state: ParallelState | None,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        bias: bool,
        bias_split: bool,
        skip_bias_add: bool,
        params_dtype: torch.dtype,
        quant_method: LinearMethodBase | None,
        prefix: str,
    ) -> None:
        super().__init__()
        # Bind the group first: the quant method may read it while creating weights.
        self.tp_group = tp_group
        self.parallel_group = parallel_group
        self.parallel_state = parallel_state or get_parallel()
        #: (rank, size) the parameters were shaped with -- the contract's group check compares it with
        #: what the loader reads from ``tp_group`` at load time.
        self.partition_rank_size = group_rank_size(tp_group)
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = list(output_partition_sizes)
        self.output_size_per_partition = sum(output_partition_sizes)
        self.skip_bias_add = skip_bias_add
        self.params_dtype = params_dtype
        self.prefix = prefix
        self.quant_method = quant_method if quant_method is not None else UnquantizedLinearMethod()
        loader = self.weight_loader_v2 if self.quant_method.uses_weight_loader_v2 else self.weight_loader
        self.quant_method.create_weights(
            self, input_size_per_partition, self.output_partition_sizes, input_size, output_size, params_dtype, loader
        )
        if bias:
            rows = self.output_size_per_partition if bias_split else output_size
            b = BaseParameter(torch.zeros(rows, dtype=params_dtype), loader, output_dim=0 if bias_split else None)
            b.param_name = f"{prefix}.bias" if prefix else "bias"
            self.bias = b
        else:
            self.register_parameter("bias", None)

    @property
    def tp_rank(self) -> int:
        return group_rank_size(self.tp_group)[0]

    @property
    def tp_size(self) -> int:
        return group_rank_size(self.tp_group)[1]

    #: Set once ``process_weights_after_loading`` ran: it may requantize, so it must run only once.
    weights_processed: bool = False

    def process_weights_after_loading(self) -> None:
        """The quant method's after-loading step, once (a second call does nothing)."""
        if self.weights_processed:
            return
        self.quant_method.process_weights_after_loading(self)
        self.weights_processed = True

    def _load_split(self, param: torch.Tensor, loaded: torch.Tensor, dim_attr: str, full: int) -> None:
        """v1 loading along the split dim named by ``dim_attr`` (``output_dim`` for column linears,
        ``input_dim`` for row linears): check the checkpoint's shape, take this rank's slice (unless
        presharded), copy. A parameter without that dim is copied whole."""
        dim = getattr(param, dim_attr, None)
        if dim is None:
            return self._load_whole(param, loaded)
        presharded = getattr(self, "use_presharded_weights", False)
        shard = param.data.shape[dim]
        expected = list(param.shape)
        expected[dim] = shard if presharded else v1_rows(param, dim, full)
        check_shape(param, loaded, expected, "presharded" if presharded else "global")
        if not presharded:
            loaded = pad_or_narrow(loaded, dim, self.tp_rank * shard, shard)
        copy_with_check(param.data, loaded, param)

    def _load_whole(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if loaded.numel() == param.numel() == 1:
            loaded = loaded.reshape(param.shape)
        check_shape(param, loaded, param.shape, "not split")
        param.data.copy_(loaded)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, per_rank=[{self.output_size_per_partition}, "
                f"{self.input_size_per_partition}], tp={self.tp_rank}/{self.tp_size}, group={self.parallel_group!r}")


class ReplicatedLinear(LinearBase):
    """Not split: every rank holds the whole weight (``tp_size`` 1) and no collective runs.

    These are the linears weight sharding targets: their weights are identical on every rank.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = True, *, skip_bias_add: bool = False,
                 params_dtype: torch.dtype = torch.float32, quant_method: LinearMethodBase | None = None,
                 prefix: str = "", parallel_state: ParallelState | None = None) -> None:
        super().__init__(input_size, output_size, tp_group=None, parallel_group="replicated",
                         parallel_state=parallel_state, input_size_per_partition=input_size,
                         output_partition_sizes=[output_size], bias=bias, bias_split=False,
                         skip_bias_add=skip_bias_add, params_dtype=params_dtype, quant_method=quant_method,
                         prefix=prefix)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        self._load_whole(param, loaded_weight)

    def weight_loader_v2(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        self._load_whole(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """``x @ W.T + b``; with ``skip_bias_add`` returns ``(output, bias)`` for a fused epilogue."""
        out = self.quant_method.apply(self, x, None if self.skip_bias_add else self.bias)
        return (out, self.bias) if self.skip_bias_add else out
