"""The shard group of our NCCL communicator, kept apart from the communicator itself: who its members
are, the CPU (gloo) group its host-side steps go over, and how its ``ncclUniqueId`` reaches them.

[Note: shard groups]
The first seed shards within intra-node groups of 8 ranks, (rank // 8) * 8, and runs DP across them.
Each group is its own NCCL communicator: rank 0 *of the group* makes an ncclUniqueId and shares it
over the group's gloo group only, so the groups never see each other's ids, and each communicator
owns its symmetric windows (registration is collective over the group, not the world). The same
grouping as ``wsharding.core.groups`` and the torch.distributed backend (``new_shard_comms``).
"""

from __future__ import annotations

from typing import Any

from wsharding.accel.nccl.binding import NcclBinding
from wsharding.core.groups import shard_group_ranks, warn_if_group_spans_nodes


def exchange_over(cpu_group: Any, world_size: int, obj: Any) -> list[Any]:
    """Every member's ``obj`` in group order, over the CPU (gloo) group; ``[obj]`` for a group of one."""
    if world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=cpu_group)
    return out


def share_unique_id(nccl: NcclBinding, rank_in_group: int, exchange: Any) -> bytes:
    """Rank 0 of the group makes the ``ncclUniqueId``; ``exchange`` (over the group's CPU group) hands
    it to every member. One id per group: ranks of other groups never receive it."""
    uid = nccl.get_unique_id() if rank_in_group == 0 else None
    return exchange(uid.to_bytes() if uid is not None else None)[0]


def group_members(cpu_group: Any, world_size: int) -> tuple[int, ...]:
    """Global ranks of ``cpu_group`` in group order (``None``: the default group, or a lone rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return tuple(range(world_size))
    if cpu_group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(cpu_group))


def gloo_group_for(ctx: Any) -> Any:
    """The CPU group of a rank context: the world group when it is gloo, else a new gloo group
    (collective: every rank calls it, once; cached in ``ctx.store``)."""
    if ctx.backend == "gloo" or ctx.world_size == 1:
        return None
    if "_wsharding_gloo" not in ctx.store:
        import torch.distributed as dist

        ctx.store["_wsharding_gloo"] = dist.new_group(backend="gloo")
    return ctx.store["_wsharding_gloo"]


def gloo_shard_group_for(ctx: Any, group_size: int) -> Any:
    """The gloo group of this rank's shard group ``(rank // g) * g`` ([Note: shard groups]).

    Collective: every rank calls it with the same ``group_size``; every group of the world is created
    on every rank, in the same order (``new_group``'s rule), and cached in ``ctx.store``. A group size
    of the whole world is :func:`gloo_group_for`. A group that spans nodes warns
    (:class:`~wsharding.core.groups.ShardGroupAcrossNodesWarning`): our communicator's gathers are for NVLink.
    """
    groups = shard_group_ranks(ctx.world_size, group_size)
    checked = ctx.store.setdefault("_wsharding_nodes_checked", set())
    if len(groups[0]) not in checked:  # [Note: shard groups and nodes], once per group size
        checked.add(len(groups[0]))
        warn_if_group_spans_nodes(ctx, group_size)
    if len(groups) == 1:
        return gloo_group_for(ctx)
    key = ("_wsharding_gloo_shard_groups", len(groups[0]))
    if key not in ctx.store:
        import torch.distributed as dist

        mine = None
        for ranks in groups:
            pg = dist.new_group(ranks, backend="gloo")
            if ctx.rank in ranks:
                mine = pg
        ctx.store[key] = mine
    return ctx.store[key]
