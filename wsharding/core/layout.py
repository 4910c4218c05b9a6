"""The flat byte layout of one sharded layer.

All weights of a layer that are to be gathered are laid end to end in one logical byte buffer T,
so that one AllGather per layer rebuilds all of them (SGLang's weight sharding for Kimi K3,
"flat layout"):

1. entries are placed in order, each at a 16-byte aligned offset;
2. the total is padded to a multiple of ``16 * N`` so that every chunk is itself 16-byte aligned;
3. rank ``i`` owns ``T[i*C : (i+1)*C]`` with ``C = |T| / N``;
4. after the gather each weight is ``T[o_j : o_j + s_j].view(dtype).view(shape)`` -- a view, no copy.

Chunk borders depend only on ``|T|`` and ``N``, never on weight borders: a chunk may hold the tail
of one weight and the head of the next. :meth:`FlatLayout.pieces` answers which byte ranges of which
weights a rank owns, which is what loading and the one-time redistribution need.

This module is pure arithmetic plus zero-copy views: it never talks to other ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from wsharding.core.errors import WshardingError, require_int
from wsharding.core.units import align_up

#: Byte alignment of every entry offset and of every chunk border.
ALIGNMENT = 16

#: The element types a layout may hold, with the short names used in tables and files.
SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int32: "int32",
}

DTYPE_BY_NAME: dict[str, torch.dtype] = {v: k for k, v in SUPPORTED_DTYPES.items()} | {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "fp8": torch.float8_e4m3fn,
}


class LayoutError(WshardingError, ValueError):
    """A layout that cannot be built or a buffer that does not fit it."""


def parse_dtype(dtype: torch.dtype | str, *, what: str = "dtype") -> torch.dtype:
    """Return the torch dtype for ``dtype`` (a torch dtype or a name such as ``"bf16"``)."""
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key not in DTYPE_BY_NAME:
            raise LayoutError(
                f"{what}: unknown dtype {dtype!r}; supported: {sorted(set(SUPPORTED_DTYPES.values()))}"
            )
        return DTYPE_BY_NAME[key]
    if dtype not in SUPPORTED_DTYPES:
        raise LayoutError(
            f"{what}: unsupported dtype {dtype}; supported: {sorted(set(SUPPORTED_DTYPES.values()))}"
        )
    return dtype


@dataclass(frozen=True)
class LayoutEntry:
    """One weight inside the flat buffer: where it starts and how many bytes it spans."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class OwnedPiece:
    """A byte range of one entry that lies inside one rank's chunk.

    ``entry_start:entry_stop`` are bytes counted from the start of the weight;
    ``chunk_start:chunk_stop`` are the same bytes counted from the start of the rank's chunk.
    """

    name: str
    entry_start: int
    entry_stop: int
    chunk_start: int
    chunk_stop: int

    @property
    def nbytes(self) -> int:
        return self.entry_stop - self.entry_start


def _check_sizes(group_size: object, alignment: object, chunk_alignment: object, where: str) -> tuple[int, int, int | None]:
    """The layout's three whole numbers checked ([Note: whole numbers only] in ``core/errors.py``): both
    constructors call it, so that ``from_entries`` refuses a group of 0 as ``FlatLayout`` does instead of
    dividing by it."""
    group_size = require_int(group_size, "group_size", minimum=1, where=where, error=LayoutError,
                             todo="pass the number of ranks that share the layer, an int >= 1")
    alignment = require_int(alignment, "alignment", minimum=ALIGNMENT, where=where, error=LayoutError,
                            todo=f"pass a power of two >= {ALIGNMENT}")
    if alignment & (alignment - 1):
        raise LayoutError(f"{where}: alignment must be a power of two >= {ALIGNMENT}, got {alignment}")
    if chunk_alignment is None:
        return group_size, alignment, None
    chunk_alignment = require_int(chunk_alignment, "chunk_alignment", minimum=alignment, where=where,
                                  error=LayoutError, todo=f"pass a power of two >= alignment ({alignment}), or None")
    if chunk_alignment & (chunk_alignment - 1):
        raise LayoutError(f"{where}: chunk_alignment must be a power of two >= alignment ({alignment}), "
                          f"got {chunk_alignment}")
    return group_size, alignment, chunk_alignment


#: Ranks shown at each end of :meth:`FlatLayout.table`.
_TABLE_RANKS = 4


class FlatLayout:
    """Byte layout of one layer's gathered weights over a group of ``group_size`` ranks.

    >>> import torch
    >>> lay = FlatLayout([("a", (3, 5), torch.bfloat16), ("b", (4,), torch.float32)], group_size=2)
    >>> [(e.name, e.offset, e.nbytes) for e in lay.entries]
    [('a', 0, 30), ('b', 32, 16)]
    >>> lay.total_bytes, lay.chunk_bytes
    (64, 32)
    """

    def __init__(
        self,
        specs: Iterable[tuple[str, Sequence[int], torch.dtype | str]],
        group_size: int,
        *,
        alignment: int = ALIGNMENT,
        chunk_alignment: int | None = None,
    ) -> None:
        group_size, alignment, chunk_alignment = _check_sizes(group_size, alignment, chunk_alignment, "FlatLayout")
        entries: list[LayoutEntry] = []
        seen: set[str] = set()
        cursor = 0
        for spec in specs:
            try:
                name, shape, dtype = spec
            except (TypeError, ValueError):
                raise LayoutError(f"each entry must be (name, shape, dtype), got {spec!r}") from None
            if not isinstance(name, str) or not name:
                raise LayoutError(f"entry name must be a non-empty string, got {name!r}")
            if name in seen:
                raise LayoutError(f"duplicate entry name {name!r}: names in one layout must be unique")
            seen.add(name)
            try:
                dims = tuple(shape) if not isinstance(shape, (str, bytes)) else None
            except TypeError:
                dims = None
            if dims is None:
                raise LayoutError(f"entry {name!r}: shape must be a sequence of ints, got {shape!r}")
            # int(d) would take a dimension of 2.5 as 2: a shape is whole numbers or refused
            shape = tuple(require_int(d, f"entry {name!r}: shape {dims!r}: dimension", error=LayoutError,
                                      todo="pass whole numbers >= 0") for d in dims)
            dtype = parse_dtype(dtype, what=f"entry {name!r}")
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * dtype.itemsize
            offset = align_up(cursor, alignment)
            entries.append(LayoutEntry(name, shape, dtype, offset, nbytes))
            cursor = offset + nbytes
        self._init_from_entries(entries, group_size, alignment, chunk_alignment)

    @classmethod
    def from_entries(
        cls, entries: Sequence[LayoutEntry], group_size: int, *, alignment: int = ALIGNMENT,
        chunk_alignment: int | None = None,
    ) -> FlatLayout:
        """Rebuild a layout from explicit entries (e.g. read back from a report), checking every
        invariant: aligned offsets, no overlap, a total divisible by ``chunk_alignment * N``."""
        group_size, alignment, chunk_alignment = _check_sizes(group_size, alignment, chunk_alignment,
                                                              "FlatLayout.from_entries")
        self = cls.__new__(cls)
        self._init_from_entries(list(entries), group_size, alignment, chunk_alignment)
        return self

    def _init_from_entries(self, entries: list[LayoutEntry], group_size: int, alignment: int,
                           chunk_alignment: int | None) -> None:
        if not entries:
            raise LayoutError("a layout needs at least one entry")
        self.group_size = group_size
        self.alignment = alignment
        #: Every chunk is a multiple of this (``alignment`` unless a backend asks for more: a chunk
        #: mapped into a layer's view must be whole pages of the GPU's allocation granularity).
        self.chunk_alignment = chunk_alignment or alignment
        self.entries: tuple[LayoutEntry, ...] = tuple(entries)
        self._by_name = {e.name: e for e in entries}
        #: Bytes up to the end of the last entry (holes between entries included).
        self.used_bytes = max(e.end for e in entries)
        # Padding the total to alignment * N makes every chunk a multiple of the alignment, so a
        # chunk (and any buffer carved at a chunk border) keeps the 16-byte alignment of its base.
        unit = self.chunk_alignment * group_size
        self.total_bytes = max(align_up(self.used_bytes, unit), unit)
        self.chunk_bytes = self.total_bytes // group_size
        self.validate()

    def validate(self) -> None:
        """Check the layout's invariants; raise :class:`LayoutError` naming the first broken one.

        Why it matters: a weight at an offset that is not a multiple of its item size cannot be
        viewed in place, and an unaligned chunk border slows every copy the gather makes.
        """
        if len(self._by_name) != len(self.entries):
            raise LayoutError("duplicate entry names in layout")
        prev_end = 0
        prev_name = None
        for e in self.entries:
            if e.offset % self.alignment:
                raise LayoutError(
                    f"entry {e.name!r} starts at byte {e.offset}, not a multiple of the "
                    f"{self.alignment}-byte alignment rule"
                )
            if e.offset < prev_end:
                raise LayoutError(f"entry {e.name!r} at byte {e.offset} overlaps {prev_name!r} (ends {prev_end})")
            if e.nbytes != e.numel * e.dtype.itemsize:
                raise LayoutError(f"entry {e.name!r}: {e.nbytes} bytes do not match {e.dtype} {e.shape}")
            prev_end, prev_name = e.end, e.name
        if self.total_bytes % (self.chunk_alignment * self.group_size):
            raise LayoutError(
                f"total {self.total_bytes} B is not a multiple of chunk_alignment*N = "
                f"{self.chunk_alignment * self.group_size}"
            )

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def payload_bytes(self) -> int:
        """Bytes that belong to weights (no alignment or tail padding)."""
        return sum(e.nbytes for e in self.entries)

    @property
    def alignment_padding_bytes(self) -> int:
        """Holes between entries inserted to keep every offset aligned."""
        return self.used_bytes - self.payload_bytes

    @property
    def tail_padding_bytes(self) -> int:
        """Bytes after the last entry that make the total divisible by ``chunk_alignment * N``."""
        return self.total_bytes - self.used_bytes

    def entry(self, name: str) -> LayoutEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise LayoutError(f"no entry named {name!r} in this layout ({self.names})") from None

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of ``T`` owned by ``rank``."""
        self._check_rank(rank)
        return rank * self.chunk_bytes, (rank + 1) * self.chunk_bytes

    def owner_of(self, byte: int) -> int:
        """Rank that owns byte ``byte`` of ``T``."""
        byte = require_int(byte, "byte", minimum=None, where="FlatLayout.owner_of", error=LayoutError)
        if not 0 <= byte < self.total_bytes:
            raise LayoutError(f"byte {byte} is outside the layout [0, {self.total_bytes})")
        return byte // self.chunk_bytes

    def pieces(self, rank: int) -> list[OwnedPiece]:
        """The byte ranges of entries that ``rank``'s chunk holds, in buffer order.

        Padding is not reported: bytes of the chunk that no piece covers are padding.
        """
        lo, hi = self.chunk_range(rank)
        out: list[OwnedPiece] = []
        for e in self.entries:
            start, stop = max(lo, e.offset), min(hi, e.end)
            if start < stop:
                out.append(OwnedPiece(e.name, start - e.offset, stop - e.offset, start - lo, stop - lo))
        return out

    # ---- views -----------------------------------------------------------------------------
    def check_buffer(self, buffer: torch.Tensor, *, device: torch.device | str | None = None) -> None:
        """Raise :class:`LayoutError` unless ``buffer`` is a contiguous 1-D uint8 tensor of
        ``total_bytes`` bytes (on ``device`` when given)."""
        if not isinstance(buffer, torch.Tensor):
            raise LayoutError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if buffer.dtype != torch.uint8:
            raise LayoutError(f"buffer must have dtype torch.uint8, got {buffer.dtype}")
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise LayoutError(f"buffer must be a contiguous 1-D tensor, got shape {tuple(buffer.shape)}")
        if buffer.numel() != self.total_bytes:
            raise LayoutError(
                f"buffer has {buffer.numel()} bytes, the layout needs exactly {self.total_bytes}"
            )
        if device is not None and buffer.device != torch.device(device):
            raise LayoutError(f"buffer is on {buffer.device}, expected {torch.device(device)}")

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Entry ``name`` as a typed, shaped view of ``buffer`` (shares its storage)."""
        self.check_buffer(buffer)
        return self._view(buffer, self.entry(name))

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """All entries as named views of ``buffer`` (no copy: every view shares its storage)."""
        self.check_buffer(buffer)
        return {e.name: self._view(buffer, e) for e in self.entries}

    def chunk(self, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s chunk as a 1-D uint8 view of ``buffer``."""
        self.check_buffer(buffer)
        lo, _ = self.chunk_range(rank)
        return buffer.narrow(0, lo, self.chunk_bytes)

    @staticmethod
    def _view(buffer: torch.Tensor, e: LayoutEntry) -> torch.Tensor:
        raw = buffer.narrow(0, e.offset, e.nbytes)
        # view(dtype) needs the storage offset to be a multiple of the item size: guaranteed by
        # the 16-byte alignment of every offset (checked in tests with a deliberately bad layout).
        return raw.view(e.dtype).view(e.shape)

    # ---- packing ---------------------------------------------------------------------------
    def pack(self, tensors: Mapping[str, torch.Tensor], *, device: torch.device | str = "cpu") -> torch.Tensor:
        """A new full buffer holding ``tensors`` at their offsets, padding zeroed."""
        buffer = torch.zeros(self.total_bytes, dtype=torch.uint8, device=device)
        for e in self.entries:
            self._view(buffer, e).copy_(self._checked_tensor(tensors, e))
        return buffer

    def fill_chunk(self, rank: int, tensors: Mapping[str, torch.Tensor], chunk: torch.Tensor) -> None:
        """Write the bytes that ``rank`` owns of each full tensor into ``chunk`` (padding zeroed).

        ``tensors`` maps entry names to full weights (any device); only the owned byte ranges are
        read, so a caller may pass weights whose other rows are not valid.
        """
        if chunk.dtype != torch.uint8 or chunk.dim() != 1 or chunk.numel() != self.chunk_bytes:
            raise LayoutError(
                f"chunk must be a 1-D uint8 tensor of {self.chunk_bytes} bytes, "
                f"got {chunk.dtype} {tuple(chunk.shape)}"
            )
        chunk.zero_()
        for p in self.pieces(rank):
            src = self._checked_tensor(tensors, self.entry(p.name))
            raw = src.contiguous().view(-1).view(torch.uint8)
            chunk[p.chunk_start : p.chunk_stop].copy_(raw[p.entry_start : p.entry_stop])

    def _checked_tensor(self, tensors: Mapping[str, torch.Tensor], e: LayoutEntry) -> torch.Tensor:
        if e.name not in tensors:
            raise LayoutError(f"missing tensor for entry {e.name!r}")
        t = tensors[e.name]
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise LayoutError(
                f"tensor for entry {e.name!r} is {t.dtype} {tuple(t.shape)}, "
                f"the layout expects {e.dtype} {e.shape}"
            )
        return t

    # ---- presentation ----------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        # a float rank would slice at fractional bytes, a bool take rank 1: whole numbers only
        require_int(rank, "rank", minimum=None, error=LayoutError,
                    todo=f"pass a rank of the group, an int in 0 .. {self.group_size - 1}")
        if not 0 <= rank < self.group_size:
            raise LayoutError(f"rank {rank} is outside the group [0, {self.group_size})")

    def table(self) -> str:
        """A readable table: entries with offsets and sizes, then each rank's chunk and pieces."""
        lines = [
            f"FlatLayout: {len(self.entries)} entries, N={self.group_size}, "
            f"total {self.total_bytes} B (payload {self.payload_bytes}, "
            f"alignment padding {self.alignment_padding_bytes}, tail padding {self.tail_padding_bytes}), "
            f"chunk {self.chunk_bytes} B",
            f"  {'name':<24} {'dtype':<9} {'shape':<18} {'offset':>12} {'bytes':>12}",
        ]
        for e in self.entries:
            lines.append(
                f"  {e.name:<24} {SUPPORTED_DTYPES[e.dtype]:<9} {str(list(e.shape)):<18} "
                f"{e.offset:>12} {e.nbytes:>12}"
            )
        n = self.group_size
        # At most the first and the last _TABLE_RANKS ranks: the text (and repr(), which is this table)
        # stays bounded whatever the group size -- one line per rank took 18 s at N = 10**6.
        shown = range(n) if n <= 2 * _TABLE_RANKS else [*range(_TABLE_RANKS), *range(n - _TABLE_RANKS, n)]
        for r in shown:
            if r == n - _TABLE_RANKS and n > 2 * _TABLE_RANKS:
                lines.append(f"  ... ranks {_TABLE_RANKS} to {n - _TABLE_RANKS - 1} ({n - 2 * _TABLE_RANKS} more): "
                             f"layout.pieces(rank) lists any of them")
            lo, hi = self.chunk_range(r)
            owned = ", ".join(f"{p.name}[{p.entry_start}:{p.entry_stop}]" for p in self.pieces(r))
            lines.append(f"  rank {r}: bytes [{lo}, {hi}) <- {owned or 'padding only'}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.table()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, FlatLayout)
            and self.entries == other.entries
            and self.group_size == other.group_size
            and self.alignment == other.alignment
            and self.chunk_alignment == other.chunk_alignment
        )

    def __hash__(self) -> int:
        return hash((self.entries, self.group_size, self.alignment, self.chunk_alignment))
