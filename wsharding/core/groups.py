"""Shard groups: which ranks store one copy of the sharded weights between them.

SGLang's weight sharding for Kimi K3 cuts intra-node sub-groups of size g (8 there) out of the TP group
by ``(rank // g) * g``, so that the gather stays on NVLink and can use the copy engine. World 8 with g =
4 gives two independent groups [0..3] and [4..7], each holding a full copy between its members.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from wsharding.core.errors import InvalidArgument


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


class ShardGroupAcrossNodesWarning(UserWarning):
    """A shard group spans several nodes: its weight gathers would cross the inter-node network at every
    layer instead of staying on NVLink inside a node ([Note: shard groups and nodes])."""


def fitting_group_size(nodes: Sequence[int]) -> int:
    """The largest group size whose groups ``(rank // g) * g`` each sit inside one node."""
    world = len(nodes)
    for g in range(world, 0, -1):
        if world % g == 0 and all(len({nodes[r] for r in range(s, s + g)}) == 1 for s in range(0, world, g)):
            return g
    return 1


def warn_if_group_spans_nodes(ctx: Any, group_size: int, *, opt_in: str = "", stacklevel: int = 2) -> None:
    """Warn (:class:`ShardGroupAcrossNodesWarning`) when ``ctx.rank``'s shard group of ``group_size``
    spans nodes ([Note: shard groups and nodes]); ``opt_in``: how the caller says it is meant."""
    nodes = getattr(ctx, "nodes", None)
    if not nodes or len(nodes) != ctx.world_size:
        return
    groups = shard_group_ranks(ctx.world_size, group_size)
    mine = groups[ctx.rank // len(groups[0])]
    spanned = sorted({nodes[r] for r in mine})
    if len(spanned) < 2:
        return
    fit = fitting_group_size(nodes)
    text = (
        f"rank {ctx.rank}: shard group {mine} (group size {len(mine)}) spans nodes {spanned}: every layer its "
        "weight gathers would cross the slower inter-node network instead of staying on NVLink inside a node. "
        f"Use a group size that fits in one node (here at most {fit}: shard groups of {fit})"
    )
    text += f", or {opt_in} if a group across nodes is what you want." if opt_in else "."
    warnings.warn(text, ShardGroupAcrossNodesWarning, stacklevel=stacklevel + 1)
