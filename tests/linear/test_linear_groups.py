"""Parallel groups and the design's shape arithmetic (no process group needed: LogicalGroup)."""

from __future__ import annotations

import pytest
import torch

from wsharding.linear import (
    ColumnParallelLinear,
    GroupError,
    LogicalGroup,
    MergedColumnParallelLinear,
    ParallelState,
    QKVParallelLinear,
    ReplicatedLinear,
    ReplicatedParallelGroup,
    RowParallelLinear,
    attn_coords,
    derive_attn_tp_size,
    group_rank_size,
    parallel_state,
    rebind_tensor,
    resolve_linear_group,
)
from wsharding.linear.groups import attn_cp_groups, attn_tp_groups, tp_rank_of


def test_qkv_seed_example_h32_k8_p8():
    for r in range(8):
        qkv = QKVParallelLinear(64, 128, 32, 8, bias=False, parallel_state=ParallelState.logical(8, r))
        assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == (4, 1, 1)
        assert qkv.output_sizes == [4096, 1024, 1024]
        assert tuple(qkv.weight.shape) == (768, 64)
        assert [(s, o, n) for s, o, n, _ in qkv.row_sub_blocks()] == [("q", 0, 512), ("k", 512, 128), ("v", 640, 128)]
    qkv = QKVParallelLinear(64, 128, 32, 8, bias=False, parallel_state=ParallelState.logical(8, 3))
    _, _, rows, ck = qkv.row_sub_blocks()[1]
    assert (ck, ck + rows) == (384, 512)  # loading K at kv rank 3 reads checkpoint rows [384, 512)


def test_qkv_seed_example_h32_k4_p8_replicas():
    blocks = []
    for r in range(8):
        qkv = QKVParallelLinear(64, 128, 32, 4, bias=False, parallel_state=ParallelState.logical(8, r))
        assert (qkv.num_kv_heads, qkv.num_kv_head_replicas) == (1, 2)
        assert qkv.row_sub_blocks()[0][3] == r * 512  # q: rank * 4 heads * 128
        blocks.append(qkv.row_sub_blocks()[1][3])
    assert blocks == [0, 0, 128, 128, 256, 256, 384, 384]  # ranks 0 and 1 hold the same K head


def test_dp_attention_seed_table():
    st = ParallelState.logical(8, 5, attn_dp_size=2)
    assert derive_attn_tp_size(tp_size=8, attn_cp_size=1, attn_dp_size=2) == 4 == st.attn_tp_size
    qkv = QKVParallelLinear(4096, 128, 32, 8, bias=False, parallel_group="attn_tp", parallel_state=st)
    o = RowParallelLinear(4096, 4096, bias=False, parallel_group="attn_tp", use_dp_attention_reduce=True, parallel_state=st)
    gu = MergedColumnParallelLinear(4096, [14336, 14336], bias=False, parallel_state=st)
    down = RowParallelLinear(14336, 4096, bias=False, parallel_state=st)
    assert qkv.output_size_per_partition == 1536 and qkv.q_size == 1024 and qkv.kv_size == 256
    assert o.input_size_per_partition == 1024 and tuple(o.weight.shape) == (4096, 1024)
    assert gu.output_size_per_partition == 3584
    assert down.input_size_per_partition == 1792
    assert group_rank_size(o.reduce_group) == (1, 4)  # rank 5 is attn_tp rank 1 of the 4-rank group
    assert group_rank_size(down.reduce_group) == (5, 8)


def test_rank_coordinates_dp_cp_tp():
    # 8 ranks, cp 2, dp 2 -> attn_tp 2; tp fastest, then cp, then dp.
    coords = [attn_coords(r, tp_size=8, attn_cp_size=2, attn_dp_size=2) for r in range(8)]
    assert coords == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(tp_rank_of(*c, attn_cp_size=2, attn_tp_size=2) == r for r, c in enumerate(coords))
    assert attn_tp_groups(8, 1, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert attn_cp_groups(8, 2, 1) == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the design's [g0, g4] ...


def test_replicated_parallel_group_logical_ranks():
    ranks = [resolve_linear_group(ReplicatedParallelGroup("tp", 2), ParallelState.logical(8, r)) for r in range(8)]
    assert [g.world_size for g in ranks] == [4] * 8
    assert [g.rank_in_group for g in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(g.collective_group() == LogicalGroup(r, 8) for r, g in enumerate(ranks))  # collectives: full group
    col = ColumnParallelLinear(16, 8, parallel_group=ReplicatedParallelGroup("tp", 2), parallel_state=ParallelState.logical(8, 5))
    assert (col.tp_rank, col.tp_size, tuple(col.weight.shape)) == (2, 4, (2, 16))


def test_group_names_resolve():
    st = ParallelState.logical(4, 2)
    assert resolve_linear_group("replicated", st) is None  # not split: rank 0 of 1
    assert group_rank_size(None) == (0, 1)
    assert resolve_linear_group(None, st) == resolve_linear_group("tp", st) == LogicalGroup(2, 4)
    assert resolve_linear_group("tp", ParallelState.logical(1, 0)) is None  # size-1 group: nothing to split
    assert resolve_linear_group("shared_experts_tp", ParallelState.logical(4, 2, shared_experts_tp_size=2)) == LogicalGroup(0, 2)
    with parallel_state(ParallelState.logical(2, 1)):
        assert ColumnParallelLinear(4, 8).tp_rank == 1
    assert ColumnParallelLinear(4, 8).tp_size == 1  # default state: one rank


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda st: QKVParallelLinear(16, 4, 6, 2, parallel_state=st), "total_num_heads 6 is not divisible by 4"),
        (lambda st: QKVParallelLinear(16, 4, 8, 3, parallel_state=st), "KV group size"),
        (lambda st: ColumnParallelLinear(16, 8, parallel_group=ReplicatedParallelGroup("tp", 3), parallel_state=st),
         "replica_size 3 does not divide the group size 4"),
        (lambda st: ColumnParallelLinear(16, 8, parallel_group="pp", parallel_state=st), "unknown linear parallel_group 'pp'"),
        (lambda st: ColumnParallelLinear(16, 8, parallel_group="shared_experts_tp", parallel_state=st),
         "shared_experts_tp group must exist"),
        (lambda st: ColumnParallelLinear(16, 8, parallel_group=ReplicatedParallelGroup("tp", 2),
                                         parallel_state=ParallelState.logical(1, 0)), "cannot replicate a size-one group"),
        (lambda st: RowParallelLinear(10, 8, parallel_state=st), "input_size 10 is not divisible by 4"),
        (lambda st: ReplicatedParallelGroup("ep", 2), "must be 'tp' or 'attn_tp'"),
        (lambda st: ParallelState.logical(8, 0, attn_dp_size=3), "not divisible by 3"),
    ],
)
def test_bad_input_raises_clear_errors(build, words):
    with pytest.raises(GroupError, match=words):
        build(ParallelState.logical(4, 0))


def test_logical_group_refuses_collectives():
    col = ColumnParallelLinear(4, 8, gather_output=True, parallel_state=ParallelState.logical(2, 0))
    with pytest.raises(GroupError, match="has no communicator"):
        col(torch.zeros(1, 4))


def test_tp1_linears_for_weight_sharding_and_plain_tensor_weight():
    x = torch.randn(3, 16)
    for lin in (ReplicatedLinear(16, 8), ColumnParallelLinear(16, 8), MergedColumnParallelLinear(16, [8, 8]),
                QKVParallelLinear(16, 4, 4, 2), RowParallelLinear(16, 8)):
        assert lin.tp_size == 1 and lin.tp_rank == 0
        assert tuple(lin.weight.shape) == (lin.output_size_per_partition, lin.input_size_per_partition)
        lin.weight.data.normal_()
        lin.bias.data.normal_()
        want = lin(x)
        # Weight sharding rebinds weight to a view of a gathered slot: forward follows it, and the
        # Parameter object (with its loader) stays what model.parameters() sees.
        param = lin.weight
        slot = lin.weight.detach().clone()
        rebind_tensor(lin, "weight", slot)
        assert lin.weight is param and isinstance(lin.weight, torch.nn.Parameter)
        assert lin.weight.data_ptr() == slot.data_ptr()
        assert any(p is param for p in lin.parameters())
        assert torch.equal(lin(x), want)
        slot.zero_()
        assert torch.equal(lin(x), lin.bias.expand_as(want))  # read at call time, not cached


def test_a_refused_qkv_names_its_linear_once():
    """The panel of notebook 05 shows this message as it is: "qkv_proj: qkv_proj: ..." read as a stutter."""
    for heads, kv in ((30, 8), (32, 3)):
        with pytest.raises(GroupError) as e:
            QKVParallelLinear(512, 128, heads, kv, prefix="qkv_proj", parallel_state=ParallelState.logical(8, 0))
        assert str(e.value).startswith("qkv_proj: ") and str(e.value).count("qkv_proj") == 1, str(e.value)
