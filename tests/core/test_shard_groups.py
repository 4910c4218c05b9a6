"""Shard groups: 4 ranks cut into 2 groups of 2 ((rank // 2) * 2), each group sharding one copy of the
weights between its members -- the design's intra-node groups of 8, at CPU scale."""

from __future__ import annotations

import pytest

from wsharding.lab.cluster import RemoteError
from wsharding.models import PRESETS
from wsharding.models.equality import model_equality

COUNTS = [[3, 5, 1, 7], [6, 2, 0, 1], [1, 4, 8, 2]]


def group_unique_ids(ctx, group_size: int) -> dict:
    """Our NCCL communicator's unique-id exchange alone, over this rank's gloo shard group: rank 0 of
    each group makes a real ``ncclGetUniqueId`` (libnccl, no GPU needed) and shares it."""
    import torch.distributed as dist

    from wsharding.accel.nccl.binding import NcclBinding
    from wsharding.accel.nccl.group import exchange_over, gloo_shard_group_for, group_members, share_unique_id
    from wsharding.accel.nccl.library import default_library

    group = gloo_shard_group_for(ctx, group_size)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    raw = share_unique_id(NcclBinding(default_library()), rank, lambda obj: exchange_over(group, size, obj))
    return {"rank_in_group": rank, "group_size": size, "group": list(group_members(group, size)), "unique_id": raw.hex()}


def test_torch_comm_in_two_groups_of_two(cluster_of):
    cfg = PRESETS["tiny"]
    results = cluster_of(4).run(model_equality, "tiny", COUNTS, group_size=2)
    n_layers = cfg.layers - 1
    per_layer = cfg.sharded_bytes_per_layer()
    total = -(-per_layer // (16 * 2)) * 16 * 2  # the layout of a group of 2, not of the world of 4
    for r in results:
        assert r["group"] == ([0, 1] if r["rank"] < 2 else [2, 3])
        assert r["equal"] == [None if COUNTS[s][r["rank"]] == 0 else True for s in range(len(COUNTS))], r
        assert r["max_abs_diff"] == 0.0
        assert r["gathers"] == [n_layers] * len(COUNTS)
        assert r["layout_bytes"] == [total] * n_layers
        # per-rank bytes of group size 2: half of every layer plus two slots
        assert r["resident_bytes"] == r["formula_bytes"] == n_layers * total // 2 + 2 * total


def test_one_unique_id_per_group(cluster_of):
    pytest.importorskip("nvidia.nccl", reason="needs libnccl (the nvidia-nccl wheel) for ncclGetUniqueId")
    res = cluster_of(4).run(group_unique_ids, 2)
    assert [(r["group"], r["rank_in_group"], r["group_size"]) for r in res] == [
        ([0, 1], 0, 2), ([0, 1], 1, 2), ([2, 3], 0, 2), ([2, 3], 1, 2)]
    ids = [r["unique_id"] for r in res]
    assert ids[0] == ids[1] and ids[2] == ids[3]  # every member gets its group's id ...
    assert ids[0] != ids[2]                       # ... and only its group's: two communicators
    assert len(bytes.fromhex(ids[0])) == 128


def test_group_size_must_divide_the_world(cluster_of):
    with pytest.raises(RemoteError, match="shard group size 3 does not divide world size 4"):
        cluster_of(4).run(group_unique_ids, 3)
