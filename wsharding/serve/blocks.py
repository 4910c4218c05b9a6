"""A paged KV pool: the K/V of every layer in blocks of :data:`BLOCK_TOKENS` tokens, handed out one
block at a time, as vLLM's PagedAttention does.

Storage is a :class:`~wsharding.models.serve_step.KVRows` of ``(blocks + 1) * BLOCK_TOKENS``
token rows (its own scratch row is the last of them): block ``b`` is rows ``[16 b, 16 b + 16)``, and
block ``blocks`` -- never handed out -- is the **scratch block**, which padding rows of a step write
and read and which fills a sequence's block table beyond its own blocks. A sequence owns a list of
blocks (its block table), grows by one block when its tokens fill the last, and gives all back when
it finishes or is preempted. Nothing fragments: any free block serves any sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.models.serve_step import KVRows

#: Tokens per KV block (vLLM's default block size).
BLOCK_TOKENS = 16


class KVBlocksFull(WshardingError, RuntimeError):
    """The pool has fewer free blocks than asked for (the scheduler checks before it takes)."""


def blocks_for(tokens: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // BLOCK_TOKENS)


class BlockPool:
    """``blocks`` KV blocks of every layer, plus the scratch block; a free list, lowest blocks first."""

    def __init__(self, storage: KVRows) -> None:
        if (storage.tokens + 1) % BLOCK_TOKENS:
            raise InvalidArgument(f"BlockPool: the storage's {storage.tokens} + 1 token rows are not whole blocks of "
                                  f"{BLOCK_TOKENS}")
        self.storage = storage
        self.blocks = (storage.tokens + 1) // BLOCK_TOKENS - 1
        if self.blocks < 1:
            raise InvalidArgument("BlockPool: need at least one block besides the scratch block")
        #: The block padding uses; never handed out.
        self.scratch_block = self.blocks
        self._free = list(range(self.blocks - 1, -1, -1))  # popped from the end: lowest first
        # one flag per block beside the list: give_back checks a returned block in O(1), not by a set of
        # the whole free list per call (a pool of a large model holds hundreds of thousands of blocks)
        self._is_free = bytearray(b"\x01") * self.blocks

    @classmethod
    def for_model(cls, model: Any, blocks: int, device: torch.device | str | None = None) -> BlockPool:
        """A pool of ``blocks`` blocks for ``model`` (a :class:`~wsharding.models.ToyDecoder`)."""
        if blocks < 1:
            raise InvalidArgument(f"BlockPool: blocks must be >= 1, got {blocks}")
        return cls(KVRows.for_model(model, (blocks + 1) * BLOCK_TOKENS - 1, device))

    def reset(self) -> None:
        """Back to a fresh pool's state, in place: every block free in a fresh pool's order and the K/V
        zeroed (as :class:`~wsharding.models.serve_step.KVRows` starts), so that a trial served on a
        reused pool hands out the blocks and reads the rows a fresh pool would -- nothing of an earlier
        trial. In place because a CUDA graph captured on this pool (:mod:`wsharding.serve.runner`)
        holds the storage's addresses: new tensors would leave the graph reading the old ones."""
        self.storage.k.zero_()
        self.storage.v.zero_()
        self._free = list(range(self.blocks - 1, -1, -1))
        self._is_free[:] = b"\x01" * self.blocks

    @property
    def tokens(self) -> int:
        """Tokens the blocks hold (the scratch block not counted)."""
        return self.blocks * BLOCK_TOKENS

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.blocks - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes allocated, the scratch block included."""
        return self.storage.nbytes

    @property
    def device(self) -> torch.device:
        return self.storage.k.device

    def take(self, count: int) -> list[int]:
        """``count`` free blocks. Raises :class:`KVBlocksFull` when fewer are free.

        A negative ``count`` is refused: sliced from the end of the free list it would hand out every
        block but ``-count`` of them, silently."""
        if count < 0:
            raise InvalidArgument(f"BlockPool.take: a count of blocks is >= 0, got {count}")
        if count > len(self._free):
            raise KVBlocksFull(f"{count} KV blocks asked, {len(self._free)} of {self.blocks} free")
        if count == 0:
            return []
        taken = self._free[-count:][::-1]
        del self._free[-count:]
        for b in taken:
            self._is_free[b] = 0
        return taken

    def give_back(self, blocks: list[int]) -> None:
        """Return a sequence's blocks. A block that is already free, or not of this pool, is refused:
        handed out twice later, two sequences would write each other's K/V."""
        seen: set[int] = set()
        for b in blocks:  # all checked before any is freed: a refused call changes nothing
            if not (isinstance(b, int) and 0 <= b < self.blocks):
                raise InvalidArgument(f"BlockPool.give_back: block {b} is not one of the pool's {self.blocks} blocks")
            if self._is_free[b] or b in seen:
                raise InvalidArgument(f"BlockPool.give_back: block {b} is already free")
            seen.add(b)
        for b in blocks:
            self._is_free[b] = 1
        self._free.extend(reversed(blocks))
