"""The model side of serving: K/V stored in token rows, and one step of rows of many sequences.

:class:`~wsharding.models.kv_cache.KVCachePool` holds whole sequences of ``max_len`` tokens that
advance together -- right for a batch that starts and ends at once. A server admits requests of
different lengths at different times, so here K/V is a flat array of token rows per layer
(:class:`KVRows`: ``k[layer]`` is ``[tokens + 1, kv_heads, head_dim]``) that any sequence's token can
use; which rows a sequence owns is the serving pool's business (``wsharding.serve.blocks.BlockPool``
hands them out in blocks of 16).

:class:`ServeStep` is one forward of the scheduler's step: its rows (tokens rounded up to a bucket,
unused ones padding that writes the scratch row) and its attention groups (per context bucket of the
step's sequences: a count of entries, a query length, a width of gathered rows masked beyond each
row's own position). Its shape (:attr:`ServeStep.shape`) is what two steps must share to run the same
kernels: the row count differs from step to step ([Note: bits across buckets] in
``wsharding/serve/step.py`` says what that changes and what it does not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.errors import InvalidArgument
from wsharding.models.kv_cache import kv_token_bytes


class KVRows:
    """``tokens`` token rows of K and V for every layer, plus one scratch row that padding rows write and read.

    Zero-filled: a masked position still enters attention's product with V at weight 0, and 0 times a
    garbage NaN would be NaN.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, tokens: int,
                 device: torch.device | str) -> None:
        if tokens < 1:
            raise InvalidArgument(f"KVRows: tokens must be >= 1, got {tokens}")
        shape = (layers, tokens + 1, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.tokens = tokens
        #: The row padding writes into and reads from; never a sequence's.
        self.scratch = tokens
        self.bytes_per_token = kv_token_bytes(layers, kv_heads, head_dim, dtype)

    @classmethod
    def for_model(cls, model: Any, tokens: int, device: torch.device | str | None = None) -> KVRows:
        """Rows for ``model`` (a :class:`~wsharding.models.ToyDecoder`: its layers, KV heads, head size, dtype)."""
        attn = model.layers[0].attn
        dev = device if device is not None else model.embed.weight.device
        return cls(len(model.layers), attn.kv_heads, attn.head_dim, model.cfg.torch_dtype, tokens, dev)

    @property
    def nbytes(self) -> int:
        """Bytes allocated, scratch row included."""
        return (self.tokens + 1) * self.bytes_per_token


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
    """One forward of ``rows`` token rows (the step's tokens rounded up to a bucket; see the module's docstring).

    ``tokens[i]`` is row i's token id; its K/V go to pool row ``write[i]``. Attention runs in
    ``groups`` (:class:`AttnGroup`), each a batch of entries of one width -- the context bucket of
    its own sequences, so a short sequence reads a short window beside a long one -- and one query
    length (1 for decode entries). The results, group after group, each flattened entry-major, go
    back to the step's rows by ``out_index`` (``[rows]``). Padding rows write the scratch row; their
    results are not read.
    """

    pool: KVRows
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
