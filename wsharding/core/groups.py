"""Shard groups: which ranks store one copy of the sharded weights between them.

SGLang's weight sharding for Kimi K3 cuts intra-node sub-groups of size g (8 there) out of the TP group
by ``(rank // g) * g``, so that the gather stays on NVLink and can use the copy engine. World 8 with g =
4 gives two independent groups [0..3] and [4..7], each holding a full copy between its members.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from wsharding.core.errors import InvalidArgument, require_int


def check_group_size(world_size: int, group_size: object, *, where: str = "shard_group_ranks") -> int:
    """``group_size`` as an int that the world can hold and divides, or :class:`InvalidArgument` /
    :class:`InvalidType` naming it, the world size and what to do.

    Never clipped: a group of 8 asked for in a world of 2 used to become a group of 2 without a word
    (a script written for ``torchrun --nproc-per-node 8`` launched with fewer processes), which shards
    the weights 2 ways instead of 8 -- four times the memory the script was sized for."""
    world = require_int(world_size, "world_size", minimum=1, where=where)
    g = require_int(group_size, "group_size", minimum=1, where=where,
                    todo=f"pass a number of ranks that divides the world of {world} ({_divisors(world)})")
    if g > world:
        raise InvalidArgument(
            f"{where}: group_size {g} is larger than the world of {world} rank(s): a shard group is made of this "
            f"job's ranks. Launch {g} processes or more (torchrun --nproc-per-node {g} script.py, or "
            f"RankCluster({g})), or pass a group size that divides {world} ({_divisors(world)})"
        )
    if world % g:
        raise InvalidArgument(
            f"{where}: shard group size {g} does not divide world size {world}: every group (rank // g) * g must "
            f"be complete; choose a group size that divides {world} ({_divisors(world)})"
        )
    return g


def _divisors(n: int) -> str:
    """The group sizes a world of ``n`` ranks can be cut into, as ``"1, 2, 4"`` (cut short past a few)."""
    found = [d for d in range(1, min(n, 4096) + 1) if n % d == 0]
    return ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 or n > 4096 else "")


def shard_group_ranks(world_size: int, group_size: int = 8) -> list[list[int]]:
    """All shard groups of a world, in order; ``group_size`` must fit the world and divide it
    (:func:`check_group_size`)."""
    g = check_group_size(world_size, group_size)
    return [list(range(start, start + g)) for start in range(0, world_size, g)]


def shard_group_of(rank: int, world_size: int, group_size: int = 8) -> list[int]:
    """The ranks of ``rank``'s shard group: ``(rank // g) * g`` up to the next multiple of g."""
    groups = shard_group_ranks(world_size, group_size)
    rank = require_int(rank, "rank", maximum=world_size - 1, where="shard_group_of")
    return groups[rank // len(groups[0])]


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
