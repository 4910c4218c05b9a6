"""QKVParallelLinear: a merged column linear split by *heads*, with GQA's K/V replication.

Q heads are split over the group: ``num_heads = H / tp``. K/V heads may be fewer than the ranks of
their group (GQA): then each rank holds one KV head and ``num_kv_head_replicas = kv_tp / K``
consecutive ranks hold the same one (they read the same checkpoint rows). K/V may also be split on
their own group (``kv_parallel_group``).

Worked example from the parallel contract of SGLang's Linear layers (H=32, K=8, P=8, head 128): 4 Q
heads + 1 K + 1 V head per rank, parameter ``[768, hidden]``; q at rows 0 (512 wide), k at 512 (128), v
at 640 (128); KV rank 3 loads checkpoint K rows ``[384, 512)``.
"""

from __future__ import annotations

import torch

from wsharding.core.errors import InvalidArgument
from wsharding.linear.column import ColumnParallelLinear, RowSubBlock
from wsharding.linear.groups import (
    GroupError,
    ParallelGroupSpec,
    ParallelState,
    divide,
    group_rank_size,
    resolve_linear_group,
)
from wsharding.linear.loading import check_shape, copy_with_check, pad_or_narrow
from wsharding.linear.parameters import QKV_INDEX, v1_rows
from wsharding.linear.quant import LinearMethodBase


def kv_head_split(total_num_kv_heads: int, kv_tp_size: int) -> tuple[int, int]:
    """``(num_kv_heads per rank, num_kv_head_replicas)``: replicas only when the group is at least the
    KV head count, and then the group must be a multiple of it."""
    if kv_tp_size >= total_num_kv_heads:
        return 1, divide(kv_tp_size, total_num_kv_heads, "KV group size (must be a multiple of total_num_kv_heads)")
    return divide(total_num_kv_heads, kv_tp_size, "total_num_kv_heads"), 1


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one column-parallel parameter ``[q_r; k_r; v_r]``.

    Checkpoint sub-tensors are loaded with shard ids ``"q"``, ``"k"``, ``"v"`` (or ``None`` for a fused
    ``[q; k; v]`` tensor). ``load_presharded_attn``: the checkpoint already holds this rank's heads.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = True, *, skip_bias_add: bool = False, params_dtype: torch.dtype = torch.float32,
                 quant_method: LinearMethodBase | None = None, prefix: str = "",
                 parallel_group: ParallelGroupSpec = None, kv_parallel_group: ParallelGroupSpec = None,
                 parallel_state: ParallelState | None = None, load_presharded_attn: bool = False) -> None:
        name = prefix or "QKVParallelLinear"
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_group = resolve_linear_group(parallel_group, parallel_state)
        self.kv_tp_group = resolve_linear_group(kv_parallel_group, parallel_state) if kv_parallel_group is not None else tp_group
        _, tp = group_rank_size(tp_group)
        _, kv_tp = group_rank_size(self.kv_tp_group)
        try:
            self.num_heads = divide(total_num_heads, tp, "total_num_heads")  # the name is added once, below
            self.num_kv_heads, self.num_kv_head_replicas = kv_head_split(self.total_num_kv_heads, kv_tp)
        except GroupError as e:
            raise GroupError(f"{name}: {e}") from None
        #: Global checkpoint widths of q, k, v (the other set of books: this rank's are below).
        self.output_sizes = [total_num_heads * head_size, self.total_num_kv_heads * head_size,
                             self.total_num_kv_heads * head_size]
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        self._init_column(hidden_size, sum(self.output_sizes), [self.q_size, self.kv_size, self.kv_size], tp_group,
                          parallel_group, parallel_state, bias, False, skip_bias_add, params_dtype, quant_method,
                          prefix, load_presharded_attn)

    @property
    def kv_tp_rank(self) -> int:
        return group_rank_size(self.kv_tp_group)[0]

    @property
    def kv_tp_size(self) -> int:
        return group_rank_size(self.kv_tp_group)[1]

    def shard_offset(self, shard_id: str) -> int:
        """Row where ``shard_id`` starts in *this rank's* parameter (per-rank head counts)."""
        return {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard_id]

    def shard_size(self, shard_id: str) -> int:
        return self.q_size if shard_id == "q" else self.kv_size

    def checkpoint_block(self, shard_id: str) -> int:
        """Which block (of ``shard_size`` rows) of the checkpoint sub-tensor this rank reads: Q by
        ``tp_rank``, K/V by ``kv_tp_rank // num_kv_head_replicas`` (replicas share a block)."""
        return self.tp_rank if shard_id == "q" else self.kv_tp_rank // self.num_kv_head_replicas

    def row_sub_blocks(self) -> list[RowSubBlock]:
        """For this rank: ``(shard_id, param_row_offset, rows_in_param, checkpoint_row_offset)`` for q, k, v."""
        return [
            (s, self.shard_offset(s), self.shard_size(s),
             0 if self.use_presharded_weights else self.checkpoint_block(s) * self.shard_size(s))
            for s in ("q", "k", "v")
        ]

    def _check_shard_id(self, shard_id: object) -> str:
        if shard_id not in QKV_INDEX:
            raise InvalidArgument(f"{self.prefix or 'QKVParallelLinear'}: loaded_shard_id must be 'q', 'k', 'v' or None "
                             f"(fused), got {shard_id!r}")
        return shard_id

    def _checkpoint_rows(self, shard_id: str) -> int:
        return self.shard_size(shard_id) if self.use_presharded_weights else self.output_sizes[QKV_INDEX[shard_id]]

    def _split_fused(self, param, loaded, rows, load):
        dim = param.output_dim
        sizes = [rows(param, dim, self._checkpoint_rows(s)) for s in ("q", "k", "v")]
        expected = list(param.shape)
        expected[dim] = sum(sizes)
        check_shape(param, loaded, expected, "fused qkv checkpoint tensor")
        offset = 0
        for s, n in zip(("q", "k", "v"), sizes, strict=True):
            load(param, loaded.narrow(dim, offset, n), s)
            offset += n

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        """v1: find the q/k/v rows of this rank's parameter and the rows of the checkpoint they come from."""
        dim = getattr(param, "output_dim", None)
        if loaded_shard_id is None:
            if dim is None:
                return self._load_whole(param, loaded_weight)
            return self._split_fused(param, loaded_weight, v1_rows, self.weight_loader)
        s = self._check_shard_id(loaded_shard_id)
        if dim is None:
            check_shape(param, loaded_weight.reshape(-1), (1,), f"shard {s}")
            param.data[QKV_INDEX[s]] = loaded_weight.reshape(())
            return
        p_off, rows = v1_rows(param, dim, self.shard_offset(s)), v1_rows(param, dim, self.shard_size(s))
        expected = list(param.shape)
        expected[dim] = v1_rows(param, dim, self._checkpoint_rows(s))
        check_shape(param, loaded_weight, expected, f"shard {s}")
        dst = param.data.narrow(dim, p_off, rows)
        if not self.use_presharded_weights:
            loaded_weight = pad_or_narrow(loaded_weight, dim, self.checkpoint_block(s) * rows, rows)
        copy_with_check(dst, loaded_weight, param, f"shard {s}")

    def weight_loader_v2(self, param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: object = None) -> None:
        """v2: Q with ``tp_rank``, K/V with ``kv_tp_rank`` and the replica count; the parameter slices."""
        if loaded_shard_id is None:
            if getattr(param, "output_dim", None) is None:
                return self._load_whole(param, loaded_weight)
            return self._split_fused(param, loaded_weight, lambda p, d, n: p.physical(d, n), self.weight_loader_v2)
        s = self._check_shard_id(loaded_shard_id)
        param.load_qkv_weight(loaded_weight, shard_id=s, shard_offset=self.shard_offset(s), shard_size=self.shard_size(s),
                              tp_rank=self.tp_rank if s == "q" else self.kv_tp_rank,
                              num_replicas=1 if s == "q" else self.num_kv_head_replicas,
                              full=self.output_sizes[QKV_INDEX[s]], presharded=self.use_presharded_weights)
