"""The workspaces that gathered layers land in: ``depth + 1`` slots for ``depth`` gathers ahead.

A full layer exists only while it computes, so with lookahead depth 1 two workspaces are enough:
layer ``l+1`` is gathered into one slot while layer ``l`` reads the other (ping-pong). Depth ``k``
keeps ``k`` gathers in flight while a layer computes, so it needs ``k + 1``. Every slot is sized by
the largest layer's flat buffer and allocated once, through the communication backend, so that a
backend with symmetric memory (our NCCL binding) hands out registered windows and every gather
lands inside one.

Which slot a layer uses is fixed at init by its position among the sharded layers (modulo the slot
count), so the binding of a layer's weights to slot views never changes: nothing is decided inside
forward. Which layer a slot *holds* is the planner's one account to keep
(:mod:`wsharding.core.slot_state`): it issues and joins the gathers.
"""

from __future__ import annotations

import torch

from wsharding.core.comm import Communicator
from wsharding.core.errors import InvalidArgument, NotFound, ShardingError
from wsharding.core.layout import FlatLayout
from wsharding.core.schedule import slot_binding, slot_name


class SlotPool:
    """``count`` workspaces of ``slot_bytes`` each (2 by default), owned by sharded layers in turn.

    ``layer_ids`` are the sharded layers in execution order; the k-th of them uses slot ``k % count``.
    """

    def __init__(self, comm: Communicator, layouts: dict[int, FlatLayout], *, tag: str = "slot",
                 count: int = 2) -> None:
        if not layouts:
            raise InvalidArgument("SlotPool needs at least one sharded layer")
        if isinstance(count, bool) or not isinstance(count, int) or count < 2:
            raise InvalidArgument(f"SlotPool: count is the number of slots, an int >= 2, got {count!r}")
        self.layer_ids = sorted(layouts)
        self.layouts = layouts
        self.count = count
        self.slot_bytes = max(lay.total_bytes for lay in layouts.values())
        self.buffers: tuple[torch.Tensor, ...] = self._allocate(comm, tag)
        self._slot_of = slot_binding(self.layer_ids, count)
        # The sharded layer that last used the same slot: the gate of a gather into that slot.
        self._previous_occupant = {
            layer: (self.layer_ids[k - count] if k >= count else None) for k, layer in enumerate(self.layer_ids)
        }

    def _allocate(self, comm: Communicator, tag: str) -> tuple[torch.Tensor, ...]:
        return tuple(comm.alloc(self.slot_bytes, tag=f"{tag}.{slot_name(s)}") for s in range(self.count))

    @property
    def total_bytes(self) -> int:
        return self.count * self.slot_bytes

    # ---- what finalize and the planner ask of a pool (a mapped pool answers differently) --------------
    def alloc_chunk(self, comm: Communicator, layer: int, tag: str) -> torch.Tensor:
        """The layer's resident chunk, allocated through the communicator."""
        return comm.alloc(self.layouts[layer].chunk_bytes, tag=tag)

    def gather_chunk(self, layer: int, chunk: torch.Tensor) -> torch.Tensor:
        """What the layer's gather sends: its resident chunk."""
        return chunk

    def scratch_views(self, layer: int) -> dict[str, torch.Tensor]:
        """Where finalize parks a layer's weights while it rebuilds them (any view of the right shape
        frees the row shards): the layer's own slot views."""
        return self.views(layer)

    def trim(self) -> None:
        """Give back what finalize needed and the steps do not: nothing, for plain slots."""

    def resident_buffers(self) -> list[torch.Tensor]:
        """The tensors that hold the slots' memory (what resident bytes count)."""
        return list(self.buffers)

    def owned_buffers(self) -> list[torch.Tensor]:
        """Every buffer this pool made (what closing a sharding releases)."""
        return list(self.buffers)

    def bound_storage_ptrs(self) -> set[int]:
        """Storages that bound weights view (not counted as weights held outside the slots)."""
        return {b.untyped_storage().data_ptr() for b in self.buffers}

    def address_only_ptrs(self) -> set[int]:
        """Storages that bound weights view but that own no memory: address ranges over memory
        counted elsewhere (none here; a mapped pool's layer views)."""
        return set()

    def slot_of(self, layer: int) -> int:
        """0 (slot A), 1 (slot B), ...: fixed by the layer's position among the sharded layers."""
        try:
            return self._slot_of[layer]
        except KeyError:
            raise NotFound(f"layer {layer} is not a sharded layer (sharded: {self.layer_ids})") from None

    def previous_occupant(self, layer: int) -> int | None:
        """The sharded layer ``count`` positions earlier, which reads the slot ``layer`` will overwrite
        (None for the first ``count`` sharded layers of a step)."""
        return self._previous_occupant[layer]

    def full_buffer(self, layer: int) -> torch.Tensor:
        """The first ``|T_layer|`` bytes of the layer's slot: where its gather writes."""
        return self.buffers[self.slot_of(layer)].narrow(0, 0, self.layouts[layer].total_bytes)

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's weights as zero-copy views of its slot."""
        return self.layouts[layer].views(self.full_buffer(layer))

    def __repr__(self) -> str:
        return f"SlotPool({self.count} x {self.slot_bytes} B)"


class SlotPolicy:
    """How a sharding's slots are made: plain slots, the chunk gathered into them (this class).

    A sharding asks its communicator for one (``comm.slot_policy(map_own_chunk)``) before it declares
    a layer, so an acceleration that lays the slots out differently comes with the communicator that
    can run it (our NCCL binding's mapped layer views, :mod:`wsharding.accel.mapped_slots`), and the
    sharding itself never needs to know which it got.
    """

    #: Whether the layer views are mapped over the resident chunks (no own-chunk copy per gather).
    mapped = False
    #: The page every chunk must be a whole number of (None: no rule beyond the layout's alignment).
    chunk_alignment: int | None = None

    def __init__(self, reason: str = "own chunk copied: plain slots") -> None:
        #: One line: which slots, and why.
        self.reason = reason

    def settle(self, layouts: dict[int, FlatLayout], world_size: int, granularity: int, *,
               slots: int = 2) -> dict[int, FlatLayout]:
        """Once every layer is declared: the layouts to build the slots for (a policy may go back to
        plain slots when its own would hold more). Plain slots keep them."""
        return layouts

    def make_pool(self, comm: Communicator, layouts: dict[int, FlatLayout], *, tag: str, count: int = 2) -> SlotPool:
        """The pool of ``count`` slots the sharding gathers into."""
        return SlotPool(comm, layouts, tag=tag, count=count)


def plain_slot_policy(comm: Communicator, map_own_chunk: bool | str) -> SlotPolicy:
    """Plain slots, with the reason, on a communicator that offers no policy of its own
    (:meth:`~wsharding.core.comm.Communicator.slot_policy`); ``map_own_chunk=True`` there is an error."""
    if map_own_chunk is True:
        raise ShardingError(
            f"map_own_chunk=True needs our NCCL communicator (comm='nccl': symmetric windows over ncclMemAlloc "
            f"pages); {type(comm).__name__} gathers into plain buffers. Leave map_own_chunk off with this one")
    if map_own_chunk is False:
        return SlotPolicy("own chunk copied: asked for (map_own_chunk=False)")
    return SlotPolicy(f"own chunk copied: {type(comm).__name__} gathers into plain buffers (mapping needs "
                      "comm='nccl', our NCCL communicator)")
