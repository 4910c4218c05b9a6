"""A KV cache counted in tokens, for continuous batching: any token of the pool can hold any sequence's K/V.

:class:`~wsharding.models.kv_cache.KVCachePool` hands out whole sequences of ``max_len`` tokens that
advance together -- right for a batch that starts and ends at once. A server admits requests of
different lengths at different times, so here the pool is a flat array of token rows per layer
(``k[layer]`` is ``[tokens + 1, kv_heads, head_dim]``) and each sequence owns a list of rows, taken
when it is admitted and given back when it finishes. Nothing fragments: a request fits exactly when
the pool has as many free rows as it will write.

:class:`ServeStep` is one forward of a fixed number of rows. Why fixed: a row's result must not
depend on which other requests share its step, or replicated and sharded -- whose pools differ, so
whose steps hold different requests -- could not be compared bit for bit. Matrix products of a fixed
shape compute each row the same way wherever it sits; of a different shape they may pick another
kernel (and another summation order). So every step has ``rows`` rows (unused ones are padding) and
its attention has fixed shapes too: per group of sequences that share a context bucket, a count of
entries, a query length and a width of gathered pool rows (masked beyond each row's own position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.models.kv_cache import kv_token_bytes


class KVPoolFull(WshardingError, RuntimeError):
    """The pool has fewer free token rows than asked for."""


class TokenKVPool:
    """``tokens`` token rows of K and V for every layer, plus one scratch row that padding rows write and read.

    Zero-filled: a masked position still enters attention's product with V at weight 0, and 0 times a
    garbage NaN would be NaN.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, tokens: int,
                 device: torch.device | str) -> None:
        if tokens < 1:
            raise InvalidArgument(f"TokenKVPool: tokens must be >= 1, got {tokens}")
        shape = (layers, tokens + 1, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.tokens = tokens
        #: The row padding writes into and reads from; never handed to a sequence.
        self.scratch = tokens
        self.bytes_per_token = kv_token_bytes(layers, kv_heads, head_dim, dtype)
        self._free = list(range(tokens - 1, -1, -1))  # popped from the end: lowest rows first

    @classmethod
    def for_model(cls, model: Any, tokens: int, device: torch.device | str | None = None) -> TokenKVPool:
        """A pool for ``model`` (a :class:`~wsharding.models.ToyDecoder`: its layers, KV heads, head size, dtype)."""
        attn = model.layers[0].attn
        dev = device if device is not None else model.embed.weight.device
        return cls(len(model.layers), attn.kv_heads, attn.head_dim, model.cfg.torch_dtype, tokens, dev)

    @property
    def free_tokens(self) -> int:
        return len(self._free)

    @property
    def used_tokens(self) -> int:
        return self.tokens - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes allocated, scratch row included."""
        return (self.tokens + 1) * self.bytes_per_token

    def take(self, count: int) -> list[int]:
        """``count`` free rows for one sequence. Raises :class:`KVPoolFull` when fewer are free."""
        if count > len(self._free):
            raise KVPoolFull(f"{count} KV tokens asked, {len(self._free)} of {self.tokens} free: "
                             "admit the request later, when finished sequences have given theirs back")
        rows = self._free[len(self._free) - count:][::-1]
        del self._free[len(self._free) - count:]
        return rows

    def give_back(self, rows: list[int]) -> None:
        """Return a finished sequence's rows."""
        self._free.extend(reversed(rows))


@dataclass(frozen=True)
class AttnGroup:
    """Entries of a step that attend over the same width: ``entries`` sequences (real ones, then
    padding entries on the scratch block), each with ``length`` query slots.

    Entry e gathers pool rows ``read[e, :]`` (its sequence's context, up to the group's width) once;
    its query slot j is step row ``rows[e, j]`` and attends where ``mask[e, j, :]`` is True (its
    sequence's tokens up to its own position). A decode entry (a sequence with one row in the step)
    has one slot; a prefill chunk has a slot per row, the group's length covering its longest chunk.
    """

    read: torch.Tensor  # [entries, width] int64
    rows: torch.Tensor  # [entries, length] int64
    mask: torch.Tensor  # [entries, length, width] bool

    @property
    def entries(self) -> int:
        return self.read.shape[0]

    @property
    def length(self) -> int:
        return self.rows.shape[1]

    @property
    def width(self) -> int:
        return self.read.shape[1]


@dataclass(frozen=True)
class ServeStep:
    """One forward of ``rows`` token rows (see the module's note on why the shapes are fixed).

    ``tokens[i]`` is row i's token id; its K/V go to pool row ``write[i]``. Attention runs in
    ``groups`` (:class:`AttnGroup`), each a batch of entries of one width -- the context bucket of
    its own sequences, so a short sequence reads a short window beside a long one -- and one query
    length (1 for decode entries). The results, group after group, each flattened entry-major, go
    back to the step's rows by ``out_index`` (``[rows]``). Padding rows write the scratch row; their
    results are not read.
    """

    pool: TokenKVPool
    tokens: torch.Tensor  # [rows] int64
    write: torch.Tensor  # [rows] int64
    groups: tuple[AttnGroup, ...]
    out_index: torch.Tensor  # [rows] int64, into the groups' results concatenated

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        """The widest group's width (the step's largest context bucket)."""
        return max(g.width for g in self.groups)

    @property
    def decode_only(self) -> bool:
        """Every group is of decode entries (one query slot each): the steps a server captures in graphs."""
        return all(g.length == 1 for g in self.groups)

    @property
    def shape(self) -> tuple[int, tuple[tuple[int, int, int], ...]]:
        """What fixes every tensor's shape: ``(rows, ((entries, length, width) per group))``. Two steps
        of one shape run the same kernels on the same shapes (a CUDA graph of one replays the other)."""
        return self.rows, tuple((g.entries, g.length, g.width) for g in self.groups)

    @property
    def gathered_rows(self) -> int:
        """Pool rows one layer's K (and as many of V) gathers: each entry's context once, at its group's width."""
        return sum(g.entries * g.width for g in self.groups)

    def gathered(self, layer: int, group: AttnGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for every entry of ``group``: ``[entries, kv_heads, width, head_dim]`` each."""
        return self.pool.k[layer][group.read].transpose(1, 2), self.pool.v[layer][group.read].transpose(1, 2)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the rows' new K and V (``[rows, kv_heads, head_dim]``) into the pool."""
        self.pool.k[layer].index_copy_(0, self.write, k)
        self.pool.v[layer].index_copy_(0, self.write, v)

    def copy_(self, other: ServeStep) -> None:
        """Take ``other``'s contents into this step's tensors (a captured graph's static inputs); the
        shapes must be equal (:attr:`shape`) and the pool the same."""
        if other.shape != self.shape or other.pool is not self.pool:
            raise InvalidArgument(f"ServeStep.copy_: a step of shape {other.shape} cannot fill one of shape "
                                  f"{self.shape} (or of another pool): capture a graph for its shape")
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            mine.copy_(theirs)

    def tensors(self) -> list[torch.Tensor]:
        """Every input tensor, in a fixed order."""
        out = [self.tokens, self.write, self.out_index]
        for g in self.groups:
            out += [g.read, g.rows, g.mask]
        return out
