"""One forward of the scheduler's step: the tokens it has, rounded up to a bucket, attending over the
context they have, rounded up to a bucket.

A server runs a step of T tokens as one of a few captured shapes (vLLM captures CUDA graphs for a
list of batch sizes and pads a step up to the next one). Here the token buckets are 1, 2, 4, 8, ...
up to the step's token budget (and the budget itself): a step costs what its tokens cost, padded by
less than 2x, never a fixed row count. Attention needs a fixed width too: a step reads its sequences'
block tables up to the step's **context bucket** (16, 32, 64, ... tokens, at least the longest
context in the step), masked beyond each row's own position -- so a step of short sequences attends
over a short window. (A paged-attention kernel would read each sequence's own length; one width per
step is the closest plain ``scaled_dot_product_attention`` gets.) Each sequence's context is gathered
once per step, as a paged-attention kernel reads it: a decode row (a sequence with one row) is one
entry of a batched attention of one query each; a prefill chunk (a sequence with several rows) is one
attention whose queries are its rows, over its context gathered once (``ServeStep.gathered_chunks``),
masked causally by position; the results go back to the step's row order. The counts of decode
entries and of chunks and the chunk length are bucketed like the tokens, so the shapes stay few. What
is still padded beyond a server: every sequence reads the step's width, and a step's chunks are padded
to its longest (a varlen kernel packs them).

[Note: bits across buckets] A row's logits can differ in the last bits between two buckets (another
shape may pick another kernel and summation order). The replicated and the sharded model serve the
same requests in different steps -- their pools differ -- so their greedy tokens may part where two
logits nearly tie. The equality that sharding promises is checked where it holds exactly: the sharded
model replays the replicated run's steps (:func:`wsharding.serve.engine.serve` with
``schedule_times``), and every token must match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wsharding.core.errors import InvalidArgument
from wsharding.models.token_pool import ServeStep
from wsharding.serve.blocks import BLOCK_TOKENS, BlockPool, blocks_for
from wsharding.serve.scheduler import Scheduled


def token_buckets(token_budget: int) -> list[int]:
    """Step sizes a step is padded up to: powers of two below ``token_budget``, then the budget."""
    sizes, n = [], 1
    while n < token_budget:
        sizes.append(n)
        n *= 2
    return sizes + [token_budget]


def context_buckets(max_context: int) -> list[int]:
    """Attention widths: powers of two from one block up to ``max_context`` rounded up to whole blocks."""
    top = blocks_for(max_context) * BLOCK_TOKENS
    sizes, n = [], BLOCK_TOKENS
    while n < top:
        sizes.append(n)
        n *= 2
    return sizes + [top]


def bucket(n: int, sizes: list[int]) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``n``."""
    for s in sizes:
        if s >= n:
            return s
    raise InvalidArgument(f"{n} is larger than the largest bucket {sizes[-1]}: raise the token budget or the "
                          "largest context it is bucketed for")


@dataclass(frozen=True)
class BuiltStep:
    """A :class:`ServeStep` and where its results go: ``sample_rows`` are the rows whose logits give
    the next token of each sampling request, in the order of the schedule."""

    step: ServeStep
    tokens: int
    sample_rows: list[int]

    @property
    def bucket_tokens(self) -> int:
        return self.step.rows

    @property
    def bucket_context(self) -> int:
        return self.step.max_len


def build_step(pool: BlockPool, scheduled: list[Scheduled], token_sizes: list[int],
               context_sizes: list[int]) -> BuiltStep:
    """The step's tensors, on the pool's device. No request scheduled: a one-token step of padding (a
    rank with nothing to do still runs every step: its gathers pair with the other ranks').

    Attention groups (see :class:`ServeStep`): a request of one row is a decode entry; one of several
    rows (a prefill chunk) is a chunk, its context gathered once for all its rows. The counts of decode
    entries and of chunks, and the chunk length, are rounded up to ``token_sizes`` too: a few shapes, as
    a server captures. The padding rows of a step share one decode entry on the scratch block (their
    results are thrown away); a step of padding alone (warmup, an idle rank, the lab's timed steps)
    gives each row its own, so that it costs what a decode step of its size does."""
    ids: list[int] = []
    positions: list[int] = []
    owner: list[int] = []
    sample_rows: list[int] = []
    decodes: list[tuple[int, int, int, int]] = []  # (table row, first position, first step row, count)
    chunks: list[tuple[int, int, int, int]] = []
    for j, s in enumerate(scheduled):
        (decodes if s.count == 1 else chunks).append((j, s.start, len(ids), s.count))
        ids += s.seq.tokens(s.start, s.start + s.count)
        positions += range(s.start, s.start + s.count)
        owner += [j] * s.count
        if s.samples:
            sample_rows.append(len(ids) - 1)
    real = len(ids)
    rows = bucket(max(real, 1), token_sizes)
    width = bucket(max((s.start + s.count for s in scheduled), default=1), context_sizes)
    pad = rows - real
    ids += [0] * pad
    positions += [0] * pad
    scratch_row = len(scheduled)  # the last table row: all scratch
    owner += [scratch_row] * pad
    out_index = [0] * rows
    for d, (_, _, row, _) in enumerate(decodes):
        out_index[row] = d
    # padding rows' decode entries: one shared, or one each in a step of padding alone (see above)
    for i in range(real, rows):
        out_index[i] = len(decodes) + (0 if scheduled else i)
    decodes += [(scratch_row, 0, i, 1) for i in range(real, rows if not scheduled else real + min(pad, 1))]
    n_dec = bucket(len(decodes), token_sizes) if decodes else 0
    decodes += [(scratch_row, 0, 0, 1)] * (n_dec - len(decodes))  # their results are not read
    n_chunks = bucket(len(chunks), token_sizes) if chunks else 0
    length = bucket(max(c for *_, c in chunks), token_sizes) if chunks else 0
    for p, (_, _, row, count) in enumerate(chunks):
        for q in range(count):
            out_index[row + q] = n_dec + p * length + q
    chunks += [(scratch_row, 0, 0, 0)] * (n_chunks - len(chunks))
    per_row = width // BLOCK_TOKENS
    scratch = pool.scratch_block
    table = [s.seq.blocks[:per_row] + [scratch] * (per_row - min(len(s.seq.blocks), per_row)) for s in scheduled]
    table.append([scratch] * per_row)
    blocks = torch.tensor(table, dtype=torch.long)
    token_rows = (blocks[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).reshape(len(table), width)
    pos = torch.tensor(positions, dtype=torch.long)
    write = token_rows[torch.tensor(owner, dtype=torch.long)].gather(1, pos[:, None]).squeeze(1)
    span = torch.arange(width)
    dec_owner = torch.tensor([t for t, *_ in decodes], dtype=torch.long)
    dec_pos = torch.tensor([x for _, x, _, _ in decodes], dtype=torch.long)
    # a chunk's slot beyond its rows stands at position 0 (one scratch token seen, so no row is all masked)
    slot_pos = torch.tensor([[x + q if q < c else 0 for q in range(length)] for _, x, _, c in chunks],
                            dtype=torch.long).view(n_chunks, length)
    slot_row = torch.tensor([[r + q if q < c else 0 for q in range(length)] for _, _, r, c in chunks],
                            dtype=torch.long).view(n_chunks, length)
    device = pool.device
    tensors = {
        "tokens": torch.tensor(ids, dtype=torch.long), "write": write,
        "read": token_rows[dec_owner], "mask": span[None, :] <= dec_pos[:, None],
        "decode_rows": torch.tensor([r for _, _, r, _ in decodes], dtype=torch.long),
        "chunk_read": token_rows[torch.tensor([t for t, *_ in chunks], dtype=torch.long)],
        "chunk_rows": slot_row, "chunk_mask": span <= slot_pos[:, :, None],
        "out_index": torch.tensor(out_index, dtype=torch.long),
    }
    step = ServeStep(pool.storage, **{k: t.to(device) for k, t in tensors.items()})
    return BuiltStep(step, real, sample_rows)
