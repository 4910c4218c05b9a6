"""The five alignment checks: an aligned model passes; one deliberately broken model per check is caught,
and each finding names the linear and the rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from wsharding.linear import (
    LogicalGroup,
    MergedColumnParallelLinear,
    ParallelState,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from wsharding.linear.contract import RULES, check_contract, contract_table
from wsharding.linear.parameters import BlockQuantScaleParameter, ModelWeightParameter
from wsharding.linear.quant import BlockInt8LinearMethod, PackedInt4LinearMethod


class Block(nn.Module):
    def __init__(self, st: ParallelState, **qkv_kw) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(64, 8, 8, 2, bias=False, parallel_group="attn_tp", parallel_state=st, **qkv_kw)
        self.o_proj = RowParallelLinear(64, 64, bias=False, parallel_group="attn_tp", use_dp_attention_reduce=True,
                                        parallel_state=st)
        self.gate_up_proj = MergedColumnParallelLinear(64, [128, 128], bias=False, parallel_state=st)
        self.down_proj = RowParallelLinear(128, 64, bias=False, parallel_state=st)
        self.router = ReplicatedLinear(64, 4, bias=False)


def aligned(r: int = 5) -> Block:
    return Block(ParallelState.logical(8, r, attn_dp_size=2))


def rules_of(model) -> set[tuple[str, str]]:
    return {(f.linear, f.rule) for f in check_contract(model)}


def test_aligned_model_has_no_findings():
    for r in range(8):
        assert check_contract(aligned(r)) == []
    rows = contract_table(aligned())
    assert [r["linear"] for r in rows] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "router"]
    assert rows[1]["reduction"] == "all-reduce over 4 ranks" and rows[3]["reduction"] == "all-reduce over 8 ranks"


def test_group_check_catches_rebound_group():
    m = aligned()
    m.gate_up_proj.tp_group = LogicalGroup(1, 4)  # loader would cut 4 ways what was shaped for 8
    f = check_contract(m)
    assert ("gate_up_proj", "group") in {(x.linear, x.rule) for x in f}
    assert "shaped for rank 5 of 8 but the loader would use rank 1 of 4" in str(f[0])


def test_size_check_catches_global_per_rank_mismatch():
    m = aligned()
    m.gate_up_proj.output_partition_sizes = [32, 16]  # one sub-tensor's per-rank width off by a factor
    assert ("gate_up_proj", "size") in rules_of(m)
    m = aligned()
    m.down_proj.input_size_per_partition = 32
    assert ("down_proj", "size") in rules_of(m)


class CarelessBlockInt8(BlockInt8LinearMethod):
    """A new quant method that forgot to check its scale blocks against shard boundaries."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, weight_loader):
        rows = sum(output_partition_sizes)
        layer.register_parameter("weight", ModelWeightParameter(
            torch.empty(rows, input_size_per_partition, dtype=torch.int8), weight_loader))
        layer.register_parameter("weight_scale_inv", BlockQuantScaleParameter(
            torch.empty(-(-rows // self.block[0]), -(-input_size_per_partition // self.block[1])), weight_loader,
            block=self.block))


def test_packing_check_catches_blocks_straddling_shards():
    st = ParallelState.logical(2, 1)
    ok = MergedColumnParallelLinear(16, [16, 16], bias=False, parallel_state=st, quant_method=BlockInt8LinearMethod((8, 8)))
    assert check_contract(ok) == []
    bad = MergedColumnParallelLinear(16, [12, 12], bias=False, parallel_state=st, quant_method=CarelessBlockInt8((8, 8)))
    f = [x for x in check_contract(bad) if x.rule == "packing"]
    assert f and f[0].linear == "." and "weight_scale_inv, sub-block 0: rows=6" in f[0].message
    packed = MergedColumnParallelLinear(16, [16, 16], bias=False, parallel_state=st, quant_method=PackedInt4LinearMethod())
    assert check_contract(packed) == []
    packed.qweight.pack_factor = 16  # the stored layout is not what the loader assumes
    assert {x.rule for x in check_contract(packed)} >= {"packing"}


def test_kv_replica_check_catches_wrong_replica_count():
    m = Block(ParallelState.logical(8, 7))  # 2 KV heads on 8 ranks: 4 replicas each
    assert (m.qkv_proj.num_kv_heads, m.qkv_proj.num_kv_head_replicas) == (1, 4)
    assert check_contract(m) == []
    m.qkv_proj.num_kv_head_replicas = 1
    f = [x for x in check_contract(m) if x.rule == "kv-replica"]
    assert f and all(x.linear == "qkv_proj" for x in f)
    assert "beyond the 16 rows" in " ".join(x.message for x in f)  # rank 7 would read K rows [56, 64) of 16


def test_reduction_check_catches_wrong_reduce_group():
    st = ParallelState.logical(8, 5, attn_dp_size=2)
    m = aligned()
    m.o_proj = RowParallelLinear(64, 64, bias=False, parallel_group="tp", use_dp_attention_reduce=True, parallel_state=st)
    f = [x for x in check_contract(m) if x.rule == "reduction"]
    assert [x.linear for x in f] == ["o_proj"]
    assert "split over a group of 8" in f[0].message and "reduced over a group of 4" in f[0].message
    m = aligned()
    m.down_proj.reduce_group_override = LogicalGroup(1, 4)
    assert ("down_proj", "reduction") in rules_of(m)


def test_unknown_rule():
    with pytest.raises(ValueError, match="unknown contract rules"):
        check_contract(aligned(), rules=("group", "nope"))
    assert RULES == ("group", "size", "packing", "kv-replica", "reduction")


class Edges(nn.Module):
    """A plain column linear, one that gathers its output, and row linears that are not split or that
    leave the reduction to the layer boundary."""

    def __init__(self, st: ParallelState) -> None:
        super().__init__()
        from wsharding.linear import ColumnParallelLinear

        self.col = ColumnParallelLinear(64, 128, bias=False, parallel_state=st)
        self.col_gather = ColumnParallelLinear(64, 128, bias=False, gather_output=True, parallel_state=st)
        self.row_boundary = RowParallelLinear(128, 64, bias=False, reduce_results=False, parallel_state=st)
        self.row_single = RowParallelLinear(128, 64, bias=False, parallel_group="replicated", parallel_state=st)


def test_contract_table_says_who_reduces_and_gathers():
    rows = {r["linear"]: r["reduction"] for r in contract_table(Edges(ParallelState.logical(4, 1)))}
    assert rows == {"col": "-", "col_gather": "all-gather over 4 ranks", "row_boundary": "layer boundary",
                    "row_single": "none (not split)"}
    assert check_contract(Edges(ParallelState.logical(4, 1))) == []


def test_size_check_names_column_merged_and_q_mismatches():
    m = Edges(ParallelState.logical(4, 1))
    m.col.output_size_per_partition = 40  # ceil(128 / 4) is 32
    found = [f for f in check_contract(m, ("size",)) if f.linear == "col"]
    assert [f.message for f in found] == [
        "40 rows per rank != ceil(128 / 4)",
        "output_partition_sizes [32] do not add up to output_size_per_partition=40",
        "weight has 32 elements on dim 0, expected 40 for 40 logical per-rank rows/columns"]
    b = aligned()
    b.gate_up_proj.output_sizes = [128, 64]  # no longer sums to the output size
    assert any("sum(output_sizes)=192 != output_size=256" in f.message for f in check_contract(b, ("size",)))
    b = aligned()
    q, k, v = b.qkv_proj.output_partition_sizes
    b.qkv_proj.output_partition_sizes = [q // 2, k, v]
    assert any(f.message.startswith(f"q: {q // 2} rows per rank x 4 ranks") for f in check_contract(b, ("size",)))
