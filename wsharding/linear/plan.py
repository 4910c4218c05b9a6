"""Per-rank shapes and checkpoint rows of one decoder layer's linears, for tables, figures and widgets.

Everything is computed by constructing the real linears with a logical parallel state for each rank
(no process group), so what the table shows is what the layers hold -- not a re-derivation.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.linear.column import MergedColumnParallelLinear
from wsharding.linear.groups import ParallelState, group_rank_size
from wsharding.linear.qkv import QKVParallelLinear
from wsharding.linear.row import RowParallelLinear


def layer_linears(state: ParallelState, *, hidden: int, heads: int, kv_heads: int, head_size: int,
                  intermediate: int) -> dict[str, Any]:
    """The four linears of a LLaMA-style layer on one rank: attention on ``attn_tp``, MLP on ``tp``.

    Built in bfloat16 with ``torch.empty`` storage: shapes are real, memory is never touched.
    """
    kw = {"bias": False, "params_dtype": torch.bfloat16, "parallel_state": state}
    return {
        "qkv_proj": QKVParallelLinear(hidden, head_size, heads, kv_heads, parallel_group="attn_tp", prefix="qkv_proj", **kw),
        "o_proj": RowParallelLinear(heads * head_size, hidden, parallel_group="attn_tp", use_dp_attention_reduce=True,
                                    prefix="o_proj", **kw),
        "gate_up_proj": MergedColumnParallelLinear(hidden, [intermediate, intermediate], prefix="gate_up_proj", **kw),
        "down_proj": RowParallelLinear(intermediate, hidden, prefix="down_proj", **kw),
    }


def layer_plan(tp_size: int = 8, attn_dp_size: int = 1, heads: int = 32, kv_heads: int = 8, head_size: int = 128,
               hidden: int = 4096, intermediate: int = 14336, attn_cp_size: int = 1) -> dict[str, Any]:
    """Every rank's shapes, groups and checkpoint rows for one layer.

    Returns ``{"config", "shapes": [row per (rank, linear)], "qkv_rows": [row per (rank, q/k/v)]}``;
    ``qkv_rows`` gives the checkpoint rows ``[start, stop)`` of the q/k/v tensor that each rank loads.
    """
    shapes, qkv_rows = [], []
    for rank in range(tp_size):
        st = ParallelState.logical(tp_size, rank, attn_dp_size=attn_dp_size, attn_cp_size=attn_cp_size)
        lins = layer_linears(st, hidden=hidden, heads=heads, kv_heads=kv_heads, head_size=head_size,
                             intermediate=intermediate)
        dp, cp, atp = st.attn_coords
        for name, lin in lins.items():
            reduce = "-"
            if isinstance(lin, RowParallelLinear):
                reduce = f"{group_rank_size(lin.reduce_group)[1]} ranks" if lin.tp_size > 1 else "none"
            shapes.append({"rank": rank, "dp": dp, "cp": cp, "attn_tp_rank": atp, "linear": name,
                           "group": lin.parallel_group, "group_rank": f"{lin.tp_rank}/{lin.tp_size}",
                           "weight": (lin.output_size_per_partition, lin.input_size_per_partition), "reduce": reduce})
        qkv = lins["qkv_proj"]
        for shard, p_off, rows, ck in qkv.row_sub_blocks():
            qkv_rows.append({"rank": rank, "dp": dp, "shard": shard, "param_rows": (p_off, p_off + rows),
                             "checkpoint_rows": (ck, ck + rows),
                             "heads": (ck // head_size, (ck + rows) // head_size),
                             "replicas": 1 if shard == "q" else qkv.num_kv_head_replicas})
    return {
        "config": {"tp_size": tp_size, "attn_dp_size": attn_dp_size, "attn_cp_size": attn_cp_size,
                   "attn_tp_size": st.attn_tp_size, "heads": heads, "kv_heads": kv_heads, "head_size": head_size,
                   "hidden": hidden, "intermediate": intermediate},
        "shapes": shapes,
        "qkv_rows": qkv_rows,
    }
