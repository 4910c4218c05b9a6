"""What a weight sharding holds, in bytes: the formula it promises and the storages it measures.

Every number here is either arithmetic on the layouts (the formula, one with the cost model's,
:func:`~wsharding.core.resident.resident_formula`) or read from the storages themselves, so the two can
be checked against each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wsharding.core.errors import ShardingError
from wsharding.core.resident import resident_formula
from wsharding.core.schedule import slot_name
from wsharding.core.units import align_up

if TYPE_CHECKING:
    import torch

    from wsharding.core.comm import Communicator
    from wsharding.core.layout import FlatLayout
    from wsharding.core.rowloaders import ShardTarget
    from wsharding.core.slots import SlotPolicy, SlotPool


class ShardingBytes:
    """The byte accounts of :class:`~wsharding.core.sharding.WeightSharding`, which derives from it."""

    comm: Communicator
    layouts: dict[int, FlatLayout]
    targets: dict[int, list[ShardTarget]]
    chunks: dict[int, torch.Tensor]
    slots: SlotPool | None
    slot_policy: SlotPolicy
    prefetch_depth: int
    stage: str

    def _expect(self, stage: str, what: str) -> None:
        if self.stage != stage:
            raise ShardingError(f"{what}() needs stage {stage!r}, the sharding is at {self.stage!r}")

    @property
    def map_own_chunk(self) -> bool:
        """Whether the layers gather into views mapped over their chunks (tentative until setup)."""
        return self.slot_policy.mapped

    @property
    def sharded_layer_ids(self) -> list[int]:
        return sorted(self.targets)

    def replicated_bytes(self) -> int:
        """R: bytes of the target weights that every rank would hold when replicated."""
        return sum(t.nbytes for ts in self.targets.values() for t in ts)

    @property
    def slot_count(self) -> int:
        """Slots the sharding gathers into: ``prefetch_depth + 1``."""
        return self.prefetch_depth + 1

    def formula_bytes(self) -> int:
        """``R/N + padding/N + (k+1) * max_l |T_l|`` for lookahead depth ``k`` (two slots at the default
        depth 1): what each rank must hold after finalize.

        A backend that allocates in units (our NCCL binding rounds every window to 4096 B, its
        ``alloc_granularity``) rounds each chunk and slot up to that unit. With ``map_own_chunk`` a
        slot keeps only the peers' pages after finalize: ``(k+1) * (N-1)/N * max_l |T_l|``.
        """
        return resident_formula(self.layouts.values(), self.comm.world_size, self.comm.alloc_granularity,
                                mapped=self.map_own_chunk, slots=self.slot_count)

    def _slot_page_bytes(self) -> int:
        """With ``map_own_chunk``: one rank's page of a slot, the largest chunk in allocation units."""
        return align_up(max(lay.chunk_bytes for lay in self.layouts.values()), self.comm.alloc_granularity)

    def finalize_bound_bytes(self) -> int:
        """The most this rank should hold while :meth:`finalize` runs: :meth:`formula_bytes` plus the
        largest weight (one layer's row shards on their way into its chunk). With ``map_own_chunk``
        also this rank's own page of each slot: finalize gathers through whole slots, and only the
        trim at its end gives those pages back."""
        own_pages = self.slot_count * self._slot_page_bytes() if self.map_own_chunk else 0
        return self.formula_bytes() + self.largest_weight_bytes() + own_pages

    def held_bytes(self) -> dict[str, int]:
        """Bytes of sharded weights this rank holds now, from the storages: ``"weights"`` (row shards,
        or full weights of requant-then-shard targets, still outside the slots), ``"chunks"``,
        ``"slots"``."""
        slot_ptrs = self.slots.bound_storage_ptrs() if self.slots else set()
        weights: dict[int, int] = {}
        for ts in self.targets.values():
            for t in ts:
                st = t.module.weight.untyped_storage()
                if st.data_ptr() not in slot_ptrs and not t.module.weight.is_meta:
                    weights[st.data_ptr()] = st.nbytes()
        return {
            "weights": sum(weights.values()),
            "chunks": sum(c.untyped_storage().nbytes() for c in self.chunks.values()),
            "slots": sum(b.untyped_storage().nbytes() for b in self.slots.resident_buffers()) if self.slots else 0,
        }

    def largest_weight_bytes(self) -> int:
        """The largest single target weight: the transient of a load or of one finalize gather."""
        return max(t.nbytes for ts in self.targets.values() for t in ts)

    def resident_bytes(self) -> int:
        """Bytes actually allocated for sharded weights on this rank (chunks + slots), measured
        from the storages, not from the layout."""
        self._expect("finalized", "resident_bytes")
        # keyed by address: a storage's Python object is made anew per call, so its id() can repeat
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*self.chunks.values(), *self.slots.resident_buffers()]}
        return sum(storages.values())

    def describe(self) -> list[dict[str, Any]]:
        """Per sharded layer: targets, layout bytes, chunk bytes and slot."""
        return [
            {
                "layer": i,
                "targets": [t.name for t in self.targets[i]],
                "layout_bytes": self.layouts[i].total_bytes,
                "chunk_bytes": self.layouts[i].chunk_bytes,
                "slot": slot_name(self.slots.slot_of(i) if self.slots else k % self.slot_count),
            }
            for k, i in enumerate(self.sharded_layer_ids)
        ]
