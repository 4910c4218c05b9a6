"""The linears on real ranks (gloo CPU processes standing in for GPUs) against a single-rank reference.

One task per world size runs every case (see wsharding.lab.tasks.linear): column, merged and QKV linears
bitwise equal to the reference, row linears within fp32 reduction tolerance with the bias counted once,
the skip switches, caller-owned outputs, replicated groups, quantised v2 parameters, DP attention.
"""

from __future__ import annotations

import pytest

from wsharding.lab.tasks.linear import REDUCE_ATOL, linear_contract_task, tp_forward_task


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_linears_match_single_rank_reference(cluster_of, world):
    results = cluster_of(world).run(linear_contract_task)
    for res in results:
        assert res["world_size"] == world and res["emulation"].startswith("emulated")
        col = res["column"]
        assert col["exact"] and all(col["exact"].values()), (res["rank"], col["exact"])
        assert col["kv_partner_equal"]
        row = res["row"]
        assert all(e <= REDUCE_ATOL for e in row["err"].values()), (res["rank"], row["err"])
        assert all(row["flags"].values()), (res["rank"], row["flags"])
        assert all(res["quant"]["exact"].values()), (res["rank"], res["quant"]["exact"])
        if world == 1:  # nothing to reduce: the single rank is the reference, bit for bit
            assert all(e == 0.0 for e in row["err"].values())
        if world >= 2:
            assert "replicated-group column gather" in col["exact"] and "replicated-group row" in row["err"]
        if world >= 4:
            dp = res["dp_attention"]
            assert dp["attn_tp_size"] == dp["reduce_group_size"] == world // 2
            assert dp["attn_tp_members"] == list(range(dp["dp_rank"] * world // 2, (dp["dp_rank"] + 1) * world // 2))
            assert dp["err"] <= REDUCE_ATOL
            assert dp["err_full_group"] > 1.0  # reducing across DP replicas mixes their requests


def test_tp_mlp_forward(cluster_of):
    res = cluster_of(4).run(tp_forward_task)
    assert [r["gate_up_weight"] for r in res] == [[64, 64]] * 4 and [r["down_weight"] for r in res] == [[64, 32]] * 4
    assert all(r["max_abs_err"] <= 1e-6 * r["ref_norm"] for r in res)
