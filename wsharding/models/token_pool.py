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
its attention has fixed shapes too: a count of decode entries and of prefill chunks, a chunk length,
and ``max_len`` gathered pool rows per sequence (masked beyond each row's own position).
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
class ServeStep:
    """One forward of ``rows`` token rows (see the module's note on why the shape is fixed).

    ``tokens[i]`` is row i's token id; its K/V go to pool row ``write[i]``. Attention runs in two
    groups, each reading a sequence's context once:

    * **decode** entries (a sequence with one row in the step; padding): entry d is step row
      ``decode_rows[d]`` and attends to pool rows ``read[d, :]`` where ``mask[d, :]`` is True;
    * **chunks** (a sequence with several rows: a prefill chunk): chunk p gathers pool rows
      ``chunk_read[p, :]`` once, and its query slot j is step row ``chunk_rows[p, j]``, attending where
      ``chunk_mask[p, j, :]`` is True (its sequence's tokens up to its own position).

    The results, decode entries then chunk slots flattened, go back to the step's rows by
    ``out_index`` (``[rows]``). Padding rows write the scratch row and attend to it alone.
    """

    pool: TokenKVPool
    tokens: torch.Tensor  # [rows] int64
    write: torch.Tensor  # [rows] int64
    read: torch.Tensor  # [decodes, max_len] int64
    mask: torch.Tensor  # [decodes, max_len] bool
    decode_rows: torch.Tensor  # [decodes] int64
    chunk_read: torch.Tensor  # [chunks, max_len] int64
    chunk_rows: torch.Tensor  # [chunks, chunk_len] int64
    chunk_mask: torch.Tensor  # [chunks, chunk_len, max_len] bool
    out_index: torch.Tensor  # [rows] int64, into decodes + chunks * chunk_len

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_len(self) -> int:
        return self.read.shape[1]

    @property
    def gathered_rows(self) -> int:
        """Pool rows one layer's K (and as many of V) gathers: one context per decode entry and per chunk."""
        return (self.read.shape[0] + self.chunk_read.shape[0]) * self.max_len

    def gathered(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for every decode entry: ``[decodes, kv_heads, max_len, head_dim]`` each."""
        return self._gather(layer, self.read)

    def gathered_chunks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` for every chunk, once per chunk: ``[chunks, kv_heads, max_len, head_dim]`` each."""
        return self._gather(layer, self.chunk_read)

    def _gather(self, layer: int, read: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.k[layer][read].transpose(1, 2), self.pool.v[layer][read].transpose(1, 2)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the rows' new K and V (``[rows, kv_heads, head_dim]``) into the pool."""
        self.pool.k[layer].index_copy_(0, self.write, k)
        self.pool.v[layer].index_copy_(0, self.write, v)
