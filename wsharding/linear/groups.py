"""Parallel groups of a Linear: which ranks split a weight between them, and how.

The parallel contract of SGLang's Linear layers, in our own code. A linear is built with a
``parallel_group``:

* ``"tp"`` (also what ``None`` -- "not given" -- means), ``"attn_tp"``, ``"shared_experts_tp"``: the named
  group of the current :class:`ParallelState`;
* ``"replicated"``: not split at all -- no group, rank 0 of 1 (:func:`group_rank_size` of ``None``);
* :class:`ReplicatedParallelGroup` ``(group, replica_size)``: ``replica_size`` consecutive ranks share
  one weight partition, while collectives still run on the full group;
* an already resolved group (:class:`LogicalGroup`, :class:`DistGroup`, :class:`ReplicatedGroup`).

Only two numbers decide shapes: "which one am I" and "how many are we". :class:`LogicalGroup` holds just
those two, so shapes and offsets are fixed before any communicator exists (tests and notebooks build
8-rank linears in one process); :class:`DistGroup` adds the ``torch.distributed`` process group that
forward's all-reduce / all-gather run on.

Rank coordinates under DP attention are ordered (dp, cp, tp), tp fastest::

    tp_rank = (attn_dp_rank * attn_cp_size + attn_cp_rank) * attn_tp_size + attn_tp_rank
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import torch

from wsharding.core.errors import WshardingError

GROUP_NAMES = ("tp", "attn_tp", "shared_experts_tp")


class GroupError(WshardingError, ValueError):
    """A parallel group could not be resolved or used (unknown name, sizes that do not divide...)."""


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator // denominator``, refusing a remainder: a remainder means a rank would hold a
    partial head / row block, which no loader can fill consistently."""
    if denominator <= 0 or numerator % denominator:
        raise GroupError(
            f"{what} {numerator} is not divisible by {denominator}: choose a group size that divides it "
            "(or, for a Column/Row linear, pass allow_padding=True to pad the last partition)"
        )
    return numerator // denominator




# ------------------------------------------------------------------------------------------------
# Resolved groups: what a linear stores as ``tp_group``
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogicalGroup:
    """A weight partition before any communicator exists: only "who am I" and "how many are we".

    Collectives on it raise :class:`GroupError` -- build the linear on ranks (``ParallelState.from_dist``)
    to run a split forward.
    """

    rank_in_group: int
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank_in_group < self.world_size:
            raise GroupError(f"LogicalGroup needs 0 <= rank_in_group < world_size, got {self.rank_in_group}, {self.world_size}")

    def collective_group(self) -> LogicalGroup:
        return self

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return _no_comm(self, "all_reduce", t)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return _no_comm(self, "all_gather", t)


def _no_comm(g: LogicalGroup, op: str, t: torch.Tensor) -> torch.Tensor:
    if g.world_size == 1:
        return t
    raise GroupError(
        f"{op} on {g}: a LogicalGroup fixes shapes but has no communicator; construct the linear on "
        "ranks with ParallelState.from_dist(ctx) to run a split forward"
    )


@dataclass(frozen=True, eq=False)
class DistGroup:
    """A torch.distributed process group with its members (global ranks, in group order)."""

    name: str
    ranks: tuple[int, ...]
    global_rank: int
    pg: Any = field(repr=False, default=None)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.global_rank)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def collective_group(self) -> DistGroup:
        return self

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the group, in place (returns ``t``)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.pg)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every member's ``t`` along ``dim``, in group order."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.pg)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class ReplicatedGroup:
    """A resolved :class:`ReplicatedParallelGroup`: ``replica_size`` consecutive ranks of ``group`` form
    one logical rank for the weight partition; collectives stay on the full ``group``.

    On the full group every partition appears ``replica_size`` times, so reductions let only the first
    replica of each partition contribute (the others send zeros) and gathers keep one block per
    partition -- each partition counted once, yet no new communicator is needed.
    """

    group: Union[LogicalGroup, DistGroup]  # noqa: UP007 - dataclass field evaluated on 3.10
    replica_size: int

    def __post_init__(self) -> None:
        if self.replica_size < 1 or self.group.world_size % self.replica_size:
            raise GroupError(
                f"replica_size {self.replica_size} does not divide the group size {self.group.world_size}: "
                "every logical rank needs the same number of replicas; choose a divisor"
            )

    @property
    def rank_in_group(self) -> int:
        return self.group.rank_in_group // self.replica_size

    @property
    def world_size(self) -> int:
        return self.group.world_size // self.replica_size

    @property
    def is_replica_leader(self) -> bool:
        return self.group.rank_in_group % self.replica_size == 0

    def collective_group(self) -> LogicalGroup | DistGroup:
        return self.group

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if not self.is_replica_leader:
            t.zero_()  # this partition is already counted by its first replica
        return self.group.all_reduce(t)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        full = self.group.all_gather(t, dim)
        if self.replica_size == 1:
            return full
        blocks = full.chunk(self.group.world_size, dim=dim)
        return torch.cat(blocks[:: self.replica_size], dim=dim)


ResolvedGroup = Union[LogicalGroup, DistGroup, ReplicatedGroup]  # noqa: UP007


@dataclass(frozen=True)
class ReplicatedParallelGroup:
    """Share weight partitions across ``replica_size`` consecutive ranks of ``group``; collectives stay
    on the full group. ``ReplicatedParallelGroup("tp", 2)`` on TP=8 gives 4 logical ranks."""

    group: Literal["tp", "attn_tp"]
    replica_size: int

    def __post_init__(self) -> None:
        if self.group not in ("tp", "attn_tp"):
            raise GroupError(f"ReplicatedParallelGroup.group must be 'tp' or 'attn_tp', got {self.group!r}")
        if not isinstance(self.replica_size, int) or self.replica_size < 1:
            raise GroupError(f"ReplicatedParallelGroup.replica_size must be an integer >= 1, got {self.replica_size!r}")


ParallelGroupSpec = Union[str, None, ReplicatedParallelGroup, LogicalGroup, DistGroup, ReplicatedGroup]  # noqa: UP007


def group_rank_size(group: ResolvedGroup | None) -> tuple[int, int]:
    """``(rank_in_group, world_size)``; ``None`` (not split) is rank 0 of 1."""
    if group is None:
        return 0, 1
    return group.rank_in_group, group.world_size


def same_collective(a: ResolvedGroup | None, b: ResolvedGroup | None) -> bool:
    """Whether two groups run their collectives on the same members (both ``None`` counts as equal)."""
    if a is None or b is None:
        return a is None and b is None
    ca, cb = a.collective_group(), b.collective_group()
    if isinstance(ca, DistGroup) and isinstance(cb, DistGroup):
        return ca.ranks == cb.ranks
    return ca == cb


# ------------------------------------------------------------------------------------------------
# DP-attention arithmetic
# ------------------------------------------------------------------------------------------------
def derive_attn_tp_size(*, tp_size: int, attn_cp_size: int = 1, attn_dp_size: int = 1) -> int:
    """What is left of the TP group for attention once attention-DP and attention-CP took their share."""
    for name, v in (("tp_size", tp_size), ("attn_cp_size", attn_cp_size), ("attn_dp_size", attn_dp_size)):
        if not isinstance(v, int) or v < 1:
            raise GroupError(f"{name} must be an integer >= 1, got {v!r}")
    return divide(tp_size, attn_dp_size * attn_cp_size, "tp_size (split into attn_dp * attn_cp)")


def attn_coords(tp_rank: int, *, tp_size: int, attn_cp_size: int = 1, attn_dp_size: int = 1) -> tuple[int, int, int]:
    """``(attn_dp_rank, attn_cp_rank, attn_tp_rank)`` of a TP rank, ordered (dp, cp, tp), tp fastest."""
    attn_tp = derive_attn_tp_size(tp_size=tp_size, attn_cp_size=attn_cp_size, attn_dp_size=attn_dp_size)
    if not 0 <= tp_rank < tp_size:
        raise GroupError(f"tp_rank {tp_rank} is outside a TP group of {tp_size}")
    return tp_rank // (attn_tp * attn_cp_size), (tp_rank // attn_tp) % attn_cp_size, tp_rank % attn_tp


def tp_rank_of(attn_dp_rank: int, attn_cp_rank: int, attn_tp_rank: int, *, attn_cp_size: int, attn_tp_size: int) -> int:
    """The inverse of :func:`attn_coords`: row-major flattening of (dp, cp, tp)."""
    return (attn_dp_rank * attn_cp_size + attn_cp_rank) * attn_tp_size + attn_tp_rank


def attn_tp_groups(tp_size: int, attn_cp_size: int = 1, attn_dp_size: int = 1) -> list[list[int]]:
    """Members of every attention-TP group (TP ranks), e.g. TP 8, DP 2 -> [[0,1,2,3],[4,5,6,7]]."""
    attn_tp = derive_attn_tp_size(tp_size=tp_size, attn_cp_size=attn_cp_size, attn_dp_size=attn_dp_size)
    return [list(range(s, s + attn_tp)) for s in range(0, tp_size, attn_tp)]


def attn_cp_groups(tp_size: int, attn_cp_size: int = 1, attn_dp_size: int = 1) -> list[list[int]]:
    """Members of every attention-CP group: same dp and tp coordinates, e.g. TP 8, CP 2, DP 2 -> [0,2]..."""
    attn_tp = derive_attn_tp_size(tp_size=tp_size, attn_cp_size=attn_cp_size, attn_dp_size=attn_dp_size)
    return [
        [tp_rank_of(dp, cp, t, attn_cp_size=attn_cp_size, attn_tp_size=attn_tp) for cp in range(attn_cp_size)]
        for dp in range(attn_dp_size)
        for t in range(attn_tp)
    ]


# ------------------------------------------------------------------------------------------------
# The parallel state a linear resolves names against
# ------------------------------------------------------------------------------------------------
@dataclass
class ParallelState:
    """Sizes, this rank's place, and (on ranks) the communicators of the named groups.

    ``ParallelState.logical(...)`` has no communicators: names resolve to :class:`LogicalGroup` (shapes
    only). ``ParallelState.from_dist(ctx, ...)`` creates the process groups on ranks.
    """

    tp_size: int = 1
    tp_rank: int = 0
    attn_dp_size: int = 1
    attn_cp_size: int = 1
    #: ``None`` means the shared-experts group does not exist (linears asking for it fail).
    shared_experts_tp_size: int | None = None
    tp_group: DistGroup | None = None
    attn_tp_group: DistGroup | None = None
    shared_experts_tp_group: DistGroup | None = None

    def __post_init__(self) -> None:
        derive_attn_tp_size(tp_size=self.tp_size, attn_cp_size=self.attn_cp_size, attn_dp_size=self.attn_dp_size)
        if not 0 <= self.tp_rank < self.tp_size:
            raise GroupError(f"tp_rank {self.tp_rank} is outside a TP group of {self.tp_size}")

    @classmethod
    def logical(cls, tp_size: int = 1, tp_rank: int = 0, *, attn_dp_size: int = 1, attn_cp_size: int = 1,
                shared_experts_tp_size: int | None = None) -> ParallelState:
        """Shapes-only state for rank ``tp_rank`` of a TP group of ``tp_size`` (no process group needed)."""
        return cls(tp_size, tp_rank, attn_dp_size, attn_cp_size, shared_experts_tp_size)

    @classmethod
    def from_dist(cls, ctx: Any = None, *, attn_dp_size: int = 1, attn_cp_size: int = 1) -> ParallelState:
        """Process groups for the whole world as one TP group (``ctx``: a RankContext or ``None``).

        Collective: every rank must call it with the same arguments. Groups are created once per
        configuration and cached in ``ctx.store`` (``new_group`` is expensive and must be called by every
        rank in the same order).
        """
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        key = ("wsharding.linear.groups", world, attn_dp_size, attn_cp_size)
        store = ctx.store if ctx is not None else _DIST_CACHE
        if key not in store:
            tp = DistGroup("tp", tuple(range(world)), rank, dist.group.WORLD)
            attn = None
            for members in attn_tp_groups(world, attn_cp_size, attn_dp_size):
                pg = dist.new_group(members)  # every rank creates every group, in the same order
                if rank in members:
                    attn = DistGroup("attn_tp", tuple(members), rank, pg)
            store[key] = (tp, attn)
        tp, attn = store[key]
        return cls(world, rank, attn_dp_size, attn_cp_size, world, tp, attn, tp)

    # attention-TP coordinates -------------------------------------------------------------------
    @property
    def attn_tp_size(self) -> int:
        return derive_attn_tp_size(tp_size=self.tp_size, attn_cp_size=self.attn_cp_size, attn_dp_size=self.attn_dp_size)

    @property
    def attn_coords(self) -> tuple[int, int, int]:
        return attn_coords(self.tp_rank, tp_size=self.tp_size, attn_cp_size=self.attn_cp_size, attn_dp_size=self.attn_dp_size)

    @property
    def attn_tp_rank(self) -> int:
        return self.attn_coords[2]

    @property
    def attn_dp_rank(self) -> int:
        return self.attn_coords[0]

    @property
    def shared_experts_tp_rank(self) -> int:
        return self.tp_rank % (self.shared_experts_tp_size or 1)

    def group_named(self, name: str) -> ResolvedGroup | None:
        """Resolve a group name (the contract's three tiers: a communicator, else a LogicalGroup when the size
        is > 1, else ``None``)."""
        if name not in GROUP_NAMES:
            raise GroupError(f"unknown linear parallel_group {name!r}: use one of {GROUP_NAMES + ('replicated',)}")
        group = getattr(self, f"{name}_group")
        if group is not None:
            return group
        if name == "shared_experts_tp" and self.shared_experts_tp_size is None:
            raise GroupError("the shared_experts_tp group must exist before construction: its partition must align "
                             "with the other groups; give ParallelState a shared_experts_tp_size")
        size = getattr(self, f"{name}_size")
        if size > 1:
            return LogicalGroup(getattr(self, f"{name}_rank"), size)
        return None


_DIST_CACHE: dict[Any, Any] = {}
_STATE: list[ParallelState] = [ParallelState()]


def get_parallel() -> ParallelState:
    """The current parallel state (a single rank, tp_size 1, unless one was set)."""
    return _STATE[-1]


@contextlib.contextmanager
def parallel_state(state: ParallelState) -> Iterator[ParallelState]:
    """Make ``state`` current for the linears built inside the ``with`` block."""
    _STATE.append(state)
    try:
        yield state
    finally:
        _STATE.pop()


def resolve_linear_group(parallel_group: ParallelGroupSpec, state: ParallelState | None = None) -> ResolvedGroup | None:
    """Translate a ``parallel_group`` argument into the group a linear stores as ``tp_group``.

    ``None`` means "not given" and resolves like ``"tp"``; ``"replicated"`` resolves to ``None`` (not split).
    """
    state = state or get_parallel()
    if isinstance(parallel_group, (LogicalGroup, DistGroup, ReplicatedGroup)):
        return parallel_group
    if isinstance(parallel_group, ReplicatedParallelGroup):
        group = resolve_linear_group(parallel_group.group, state)
        if group is None:
            if parallel_group.replica_size != 1:
                raise GroupError(
                    f"cannot replicate a size-one group: {parallel_group} on a {parallel_group.group} group of 1 rank"
                )
            return None
        if not isinstance(group, (LogicalGroup, DistGroup)):
            raise GroupError(f"{parallel_group}: the underlying group must be plain, got {group}")
        return ReplicatedGroup(group, parallel_group.replica_size)
    if parallel_group == "replicated":
        return None
    name = "tp" if parallel_group is None else parallel_group
    if not isinstance(name, str):
        raise GroupError(f"parallel_group must be a name, a ReplicatedParallelGroup or a group, got {parallel_group!r}")
    return state.group_named(name)
