"""Slots whose layer views are mapped over the resident chunks: no own-chunk copy per gather.

[Note: the own chunk mapped, not copied]
A gather into a plain slot first puts the rank's own chunk into its slice of the slot: a same-device
copy, which runs on the SMs (~100 us per 218 MB layer on an H200, taken from the layer's compute at
2048 tokens per rank; [Note: no serial local copy] in ``wsharding/accel/nccl/gather.py``). The bytes
are already in memory, only at the wrong address. CUDA's virtual memory API moves the address
instead of the bytes: each sharded layer gets its own address range of the layer's full size, and

* this rank's slice of it maps the pages of the layer's resident chunk,
* every other slice maps the pages of one slot (slot A or B, by the layer's parity),

so the range *is* the layer's gathered buffer once the peers' slices arrive. The gather runs in
place -- the send buffer is the own slice of the range -- and moves only the peers' (N-1)/N of the
layer over the copy engines; the weights are views of the range, as they were of the slot. Slots
keep their role: a slot is N pages of the largest chunk each, mapped side by side into one range
(finalize still packs rows and rebuilds full weights in it); the layers of one parity share its
pages, so the gate rules are the slots' own ([Note: the gate] in ``wsharding/core/planner.py``).

Once finalize is done, nothing reads a slot's own page any more -- every layer view maps its chunk
there -- so :meth:`MappedSlotPool.trim` gives the two slot ranges back (their windows deregistered,
collective) and frees the two own pages: each rank then holds ``R/N + 2 (N-1)/N max|T|`` (plus
padding to whole pages), not ``R/N + 2 max|T|``. The pool has no full slot after that, so finalize
cannot run on it again.

What it needs, each checked before anything is allocated:

* our NCCL communicator (its ``ncclMemAlloc`` pages and its symmetric windows); the layer ranges
  are registered as windows like the slots, in tag order on every rank;
* NCCL >= 2.30: a window over several allocations. NCCL 2.29 refuses one ("span multiple physical
  segments"); NCCL 2.28 registers it but shares only the first allocation's pages with the peers
  (``src/dev_runtime.cc``: one ``cuMemRetainAllocationHandle`` at the range's start), so a peer would
  write past what it mapped -- silent corruption, which the version gate refuses up front;
* every chunk whole pages of the allocation granularity (2 MiB on an H200): the layouts are built
  with ``chunk_alignment`` = that page, which adds at most a page of padding per layer and rank.

[Note: map_own_chunk="auto"]
It is the default of :class:`~wsharding.core.sharding.WeightSharding` and ``shard_blocks``: on where it can
run, off with the reason kept (``ws.map_own_chunk_reason``). Measured on two H200s, the mapped
sharding was faster than the plain one at every token count (1 to 8192 per rank) and it holds less after
finalize; where it cannot run (another communicator, an NCCL older than 2.30) nothing changes. The
one case where it costs: page padding. Every chunk is rounded up to a 2 MiB page, so a model of many
small layers could hold more mapped than plain. ``setup()``, once every layer is declared, prices
both with :func:`~wsharding.core.resident.resident_formula` and keeps the layouts of the smaller; a tie goes to
mapping (no own-chunk copy). ``map_own_chunk=True`` forces it (and raises where it cannot run),
``False`` keeps plain slots.

Measured on one H200 (NCCL 2.32.3, 2 and 4 ranks on the GPU): the range registers, the in-place
copy-engine gather fills every slice, the chunk's pages are untouched, no kernel runs.
"""

from __future__ import annotations

from typing import Literal

import torch

from wsharding.accel.cuda_vmm import VirtualMemory
from wsharding.accel.nccl.library import MIN_MAPPED_VIEW
from wsharding.accel.nccl.symmetric import wrap_device_memory
from wsharding.core.comm import Communicator
from wsharding.core.errors import ShardingError
from wsharding.core.layout import FlatLayout
from wsharding.core.resident import resident_formula
from wsharding.core.schedule import slot_name
from wsharding.core.slots import SlotPolicy, SlotPool


def mapping_unavailable(comm: Communicator, *, required: bool = False) -> str | None:
    """Why ``comm`` cannot map layer views, in one line; None when it can. The one place that checks
    both rules: our NCCL communicator (its pool of windows and its library), and NCCL >= 2.30 (a
    window over several allocations). ``map_own_chunk="auto"`` asks before choosing ([Note:
    map_own_chunk="auto"]); ``required`` (``map_own_chunk=True``) raises instead, naming the rule and
    the fix."""
    library = comm.library
    if comm.pool is None or library is None:
        if required:
            raise ShardingError(
                f"map_own_chunk=True needs our NCCL communicator (comm='nccl': symmetric windows over ncclMemAlloc "
                f"pages); {type(comm).__name__} gathers into plain buffers. Leave map_own_chunk off with this one")
        return f"{type(comm).__name__} gathers into plain buffers (mapping needs comm='nccl', our NCCL communicator)"
    if not library.supports(MIN_MAPPED_VIEW):
        if required:
            library.require(MIN_MAPPED_VIEW, "map_own_chunk (a symmetric window over several allocations; "
                                             "NCCL 2.28 would share only the first with the peers)")
        return (f"NCCL {library.version_str} ({library.source}) is older than "
                f"{'.'.join(map(str, MIN_MAPPED_VIEW))}: it cannot window several allocations")
    return None


def mapping_page_bytes(comm: Communicator) -> int:
    """The page every chunk must be a whole number of (the GPU's allocation granularity), once
    :func:`mapping_unavailable` found that ``comm`` can map layer views; raises otherwise."""
    mapping_unavailable(comm, required=True)
    return VirtualMemory(comm.device.index).granularity()


class MappedSlotPool(SlotPool):
    """A :class:`SlotPool` whose layers gather into ranges mapped over their chunks (see the note).

    The layouts must have been made with ``chunk_alignment=mapping_page_bytes(comm)``.
    """

    def __init__(self, comm: Communicator, layouts: dict[int, FlatLayout], *, tag: str = "slot",
                 count: int = 2) -> None:
        self.page = mapping_page_bytes(comm)
        for layer, lay in sorted(layouts.items()):
            if lay.chunk_bytes % self.page:
                raise ShardingError(
                    f"layer {layer}: chunk of {lay.chunk_bytes} B is not whole {self.page}-byte pages, so it cannot be "
                    "mapped into the layer's view: build the layouts with chunk_alignment=mapping_page_bytes(comm) "
                    "(WeightSharding(..., map_own_chunk=True) does)")
        self.comm = comm
        self.vm = VirtualMemory(comm.device.index)
        self._tag = tag
        self._pages: list[list[list[torch.Tensor]]] = []  # [slot][rank][segment]
        self._segments: list[list[int]] = []  # [slot]: the bytes of each segment of a page
        self._views: dict[int, torch.Tensor] = {}
        super().__init__(comm, layouts, tag=tag, count=count)

    def segment_bytes(self, slot: int) -> list[int]:
        """The allocations one rank's page of ``slot`` is made of, in bytes: cut at the chunk size of
        every layer of the slot, so that a layer's view maps whole allocations.

        Why cut: ``cuMemMap`` maps an allocation whole. Mapping only the first bytes of a larger one
        fails with ``CUDA_ERROR_NOT_SUPPORTED`` (801) -- seen on an H200 with a draft model whose dense
        layer 0 is smaller than its MoE layer 1 sharing a page with it. A model whose layers are all of
        one size has one segment per page."""
        piece = self.slot_bytes // self.comm.world_size  # the largest chunk: whole pages, checked above
        cuts = sorted({self.layouts[i].chunk_bytes for k, i in enumerate(self.layer_ids) if k % self.count == slot} | {piece})
        return [end - start for start, end in zip([0, *cuts[:-1]], cuts, strict=True)]

    def _allocate(self, comm: Communicator, tag: str) -> tuple[torch.Tensor, ...]:
        slots = []
        for s in range(self.count):
            name = slot_name(s)
            sizes = self.segment_bytes(s)
            # pages reached only through the slot's range and the layer views: no window of their own
            pages = [[comm.pool.alloc(b, f"{tag}.{name}.page.{r}.{j}", window=False) for j, b in enumerate(sizes)]
                     for r in range(comm.world_size)]
            self._pages.append(pages)
            self._segments.append(sizes)
            slots.append(self._compose(f"{tag}.{name}", [(seg, b) for page in pages for seg, b in zip(page, sizes,
                                                                                                    strict=True)]))
        return tuple(slots)

    def _compose(self, tag: str, pieces: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """One address range made of the first ``nbytes`` of each piece's allocation, side by side;
        adopted by the communicator's pool (a window at the next ``register_all``)."""
        vm = self.vm
        total = sum(nbytes for _, nbytes in pieces)
        base = vm.reserve(total)
        mapped: list[tuple[int, int]] = []

        def undo() -> None:
            for ptr, nbytes in reversed(mapped):
                vm.unmap(ptr, nbytes)
            vm.free_range(base, total)

        try:
            at = base
            for owner, nbytes in pieces:
                handle = vm.retain(owner.data_ptr())
                try:
                    vm.map(at, nbytes, handle)
                finally:
                    vm.release(handle)  # the mapping keeps the pages alive
                mapped.append((at, nbytes))
                at += nbytes
        except BaseException:
            undo()
            raise
        view = wrap_device_memory(base, total, self.comm.device)
        self.comm.pool.adopt(view, tag, undo)
        return view

    # ---- what finalize and the planner ask of a pool ------------------------------------------------
    def alloc_chunk(self, comm: Communicator, layer: int, tag: str) -> torch.Tensor:
        """The layer's chunk (its own ``ncclMemAlloc`` pages), and the layer's view over it and over
        the slot's pages of the other ranks."""
        c, rank = self.layouts[layer].chunk_bytes, comm.rank
        chunk = comm.pool.alloc(c, tag, window=False)
        slot = self.slot_of(layer)
        sizes = self._segments[slot]
        # a peer's slice: the first segments of its page, which add up to this chunk (segment_bytes)
        count = next(k for k in range(1, len(sizes) + 1) if sum(sizes[:k]) == c)
        pieces: list[tuple[torch.Tensor, int]] = []
        for r in range(comm.world_size):
            if r == rank:
                pieces.append((chunk, c))
            else:
                pieces += zip(self._pages[slot][r][:count], sizes[:count], strict=True)
        self._views[layer] = self._compose(f"{self._tag}.view.{layer}", pieces)
        return chunk

    def full_buffer(self, layer: int) -> torch.Tensor:
        """The layer's own view (its gather's receive buffer, the storage its weights view)."""
        try:
            return self._views[layer]
        except KeyError:
            raise ShardingError(f"layer {layer}: its view is made with its chunk (finalize); asked before") from None

    def gather_chunk(self, layer: int, chunk: torch.Tensor) -> torch.Tensor:
        """The own slice of the layer's view: the same pages as ``chunk``, at the address that makes
        the gather in place (no copy)."""
        c = self.layouts[layer].chunk_bytes
        return self._views[layer].narrow(0, self.comm.rank * c, c)

    def scratch_views(self, layer: int) -> dict[str, torch.Tensor]:
        """The last slot's first bytes (the layer's view needs its chunk, which does not exist yet)."""
        if not self.buffers:
            raise ShardingError(f"layer {layer}: the mapped slots were trimmed after finalize (their own pages freed); "
                                "there is no full slot to rebuild weights in. Shard a fresh model to finalize again")
        return self.layouts[layer].views(self.buffers[-1].narrow(0, 0, self.layouts[layer].total_bytes))

    def trim(self) -> None:
        """Collective, once, after finalize: give back every slot range and this rank's page of each
        (see the note). What stays: the layer views and the other ranks' pages under them."""
        if not self.buffers:
            return
        missing = [i for i in self.layouts if i not in self._views]
        if missing:
            raise ShardingError(f"layers {missing}: trim() before finalize made their views; the slots are still needed")
        rank = self.comm.rank
        self.comm.pool.release(list(self.buffers))  # collective: the windows over the slot ranges
        self.buffers = ()
        own = [seg for pages in self._pages for seg in pages[rank]]
        self.comm.pool.free_unshared(own)  # reached through no range any more
        self._pages = [[p for r, p in enumerate(pages) if r != rank] for pages in self._pages]

    def resident_buffers(self) -> list[torch.Tensor]:
        """The slots' memory: all their pages before :meth:`trim`, the peers' pages after."""
        return [seg for pages in self._pages for page in pages for seg in page]

    def owned_buffers(self) -> list[torch.Tensor]:
        return [*self._views.values(), *self.buffers, *self.resident_buffers()]

    def bound_storage_ptrs(self) -> set[int]:
        return super().bound_storage_ptrs() | self.address_only_ptrs()

    def address_only_ptrs(self) -> set[int]:
        # A layer view maps the layer's chunk and the peers' pages: counting it would count them twice.
        return {v.untyped_storage().data_ptr() for v in self._views.values()}

    def __repr__(self) -> str:
        return f"MappedSlotPool({self.count} x {self.slot_bytes} B, {len(self._views)} layer views)"


class MappedSlotPolicy(SlotPolicy):
    """The slot policy of our NCCL communicator: layer views mapped over the chunks where they can
    run and hold no more than plain slots ([Note: map_own_chunk="auto"]); ``True`` forces them
    (raises where they cannot run), ``False`` keeps plain slots."""

    def __init__(self, comm: Communicator, map_own_chunk: bool | Literal["auto"] = "auto") -> None:
        self.auto = map_own_chunk == "auto"
        why_not = mapping_unavailable(comm, required=map_own_chunk is True) if map_own_chunk else "asked for"
        self.mapped = why_not is None
        if not map_own_chunk:
            reason = "own chunk copied: asked for (map_own_chunk=False)"
        elif not self.mapped:
            reason = f"own chunk copied: {why_not}"
        elif self.auto:
            reason = "own chunk mapped (tentative: setup() compares the page padding)"
        else:
            reason = "own chunk mapped: asked for (map_own_chunk=True)"
        super().__init__(reason)
        # Checked before anything is declared: a chunk must be whole pages to be mapped.
        self.chunk_alignment = mapping_page_bytes(comm) if self.mapped else None

    def settle(self, layouts: dict[int, FlatLayout], world_size: int, granularity: int, *,
               slots: int = 2) -> dict[int, FlatLayout]:
        """[Note: map_own_chunk="auto"]: keep the page-aligned layouts only if mapping holds no more
        than plain slots would. The layouts are metadata until finalize: nothing was cut by them yet
        (setup keeps rows, and rows do not depend on the chunk size)."""
        if not (self.auto and self.mapped and layouts):
            return layouts
        # the same entries at the same offsets: only the chunk's alignment (so the tail padding) differs
        plain = {i: FlatLayout.from_entries(lay.entries, world_size, alignment=lay.alignment)
                 for i, lay in layouts.items()}
        mapped_bytes = resident_formula(layouts.values(), world_size, granularity, mapped=True, slots=slots)
        plain_bytes = resident_formula(plain.values(), world_size, granularity, mapped=False, slots=slots)
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        if mapped_bytes <= plain_bytes:
            self.reason = (f"own chunk mapped: {mib(mapped_bytes)} per rank against {mib(plain_bytes)} with "
                           "plain slots, and no own-chunk copy per gather")
            return layouts
        self.reason = (f"own chunk copied: mapped, the {self.chunk_alignment >> 20} MiB page padding of every chunk "
                       f"would hold {mib(mapped_bytes)} per rank against {mib(plain_bytes)} with plain slots")
        self.mapped = False
        self.chunk_alignment = None
        return plain

    def make_pool(self, comm: Communicator, layouts: dict[int, FlatLayout], *, tag: str, count: int = 2) -> SlotPool:
        return (MappedSlotPool if self.mapped else SlotPool)(comm, layouts, tag=tag, count=count)
