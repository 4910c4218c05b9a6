"""Shard groups: which ranks store one copy of the sharded weights between them.

SGLang's weight sharding for Kimi K3 cuts intra-node sub-groups of size g (8 there) out of the TP group
by ``(rank // g) * g``, so that the gather stays on NVLink and can use the copy engine. World 8 with g =
4 gives two independent groups [0..3] and [4..7], each holding a full copy between its members.
"""

from __future__ import annotations

from wsharding.errors import InvalidArgument


def shard_group_ranks(world_size: int, group_size: int = 8) -> list[list[int]]:
    """All shard groups of a world, in order. ``group_size`` is clipped to the world size."""
    if world_size < 1:
        raise InvalidArgument(f"world_size must be >= 1, got {world_size}")
    if group_size < 1:
        raise InvalidArgument(f"shard group size must be >= 1, got {group_size}")
    g = min(group_size, world_size)
    if world_size % g:
        raise InvalidArgument(
            f"shard group size {g} does not divide world size {world_size}: every group must be "
            f"complete; choose a group size that divides {world_size}"
        )
    return [list(range(start, start + g)) for start in range(0, world_size, g)]


def shard_group_of(rank: int, world_size: int, group_size: int = 8) -> list[int]:
    """The ranks of ``rank``'s shard group: ``(rank // g) * g`` up to the next multiple of g."""
    groups = shard_group_ranks(world_size, group_size)
    g = len(groups[0])
    return groups[rank // g]
