"""One forward of the scheduler's step: the tokens it has, rounded up to a bucket, each sequence
attending over its own context, rounded up to a bucket.

A server runs a step of T tokens as one of a few captured shapes (vLLM captures CUDA graphs for a
list of batch sizes and pads a step up to the next one). Here the token buckets are 1, 2, 4, 8, ...
up to the step's token budget (and the budget itself): a step costs what its tokens cost, padded by
less than 2x, never a fixed row count. Attention needs fixed widths too: a sequence reads its block
table up to its **own context bucket** (16, 32, 64, ... tokens, at least its last position), masked
beyond each row's own position. The step's sequences are grouped by that bucket -- decode entries
(a sequence with one row) apart from prefill chunks (a sequence with several rows) -- and each group
runs one batched attention: a decode entry is one query over its context; a chunk's rows are the
queries of one attention over its context, gathered once, masked causally by position; the results
go back to the step's row order. So a short sequence beside a long one reads its short window. The
count of entries of each group and a chunk group's length are bucketed like the tokens, so the shapes
stay few (:attr:`~wsharding.models.serve_step.ServeStep.shape`). What is still padded beyond a
server: a sequence reads up to its bucket (less than 2x its context; a paged-attention kernel reads
its exact length), a group's entries are padded to its bucket, and the chunks of a group to its
longest (a varlen kernel packs them). The price of the groups is a launch per group and layer: a
step of sequences of k buckets runs k attentions where one width for all would run one.

[Note: bits across buckets] A row's logits can differ in the last bits between two step shapes
(another token bucket, or another count of entries in its group, may pick another kernel and
summation order). Within one shape, a row's result depends only on its own sequence: its group reads
only its own context, and the other groups' rows enter its attention nowhere. The replicated and the
sharded model run this same code, so the same step gives the same bits in both; but they serve the
same requests in different steps -- their pools differ -- so their greedy tokens may part where two
logits nearly tie. The equality that sharding promises is checked where it holds exactly: the sharded
model replays the replicated run's steps (:func:`wsharding.serve.engine.serve` with
``schedule_times``), or both serve with pools of one size, and every token must match. A step
replayed from a CUDA graph of its shape runs the same kernels as the eager step
(:mod:`wsharding.serve.runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from wsharding.core.errors import InvalidArgument
from wsharding.models.serve_step import AttnGroup, ServeStep
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


def step_buckets(scheduled: list[Scheduled], token_sizes: list[int], context_sizes: list[int]) -> tuple[int, int]:
    """(token bucket, context bucket) of the step :func:`build_step` builds for ``scheduled``: its
    tokens rounded up to ``token_sizes`` (a step of nothing is one padding token), its widest group --
    the bucket of its longest context (``context_sizes``; a step of padding reads one position) -- the
    shape a step-time profile prices (:mod:`wsharding.serve.predict`)."""
    tokens = sum(s.count for s in scheduled)
    longest = max((s.start + s.count for s in scheduled), default=1)
    return bucket(max(tokens, 1), token_sizes), bucket(longest, context_sizes)


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
    """The step's tensors, on the pool's device. No request scheduled: a step of padding (a rank with
    nothing to do still runs every step: its gathers pair with the other ranks').

    Attention groups (see :class:`~wsharding.models.serve_step.AttnGroup`): a request of one row is a
    decode entry; one of several rows (a prefill chunk) is a chunk, its context gathered once for all
    its rows. Entries are grouped by their **own** context bucket (``context_sizes`` holding their last
    position), decode entries apart from chunks; a group's count of entries, and a chunk group's length,
    are rounded up to ``token_sizes``: a few shapes, as a server captures. Groups are ordered decodes
    first, then by width. The padding rows of a step with requests have no entry (their results are
    not read); a step of padding alone (warmup, an idle rank, the timed steps of
    :func:`wsharding.serve.runner.time_step`) gives each row a decode entry of the smallest width, so
    that it costs what a decode step of its size does."""
    ids: list[int] = []
    positions: list[int] = []
    owner: list[int] = []
    sample_rows: list[int] = []
    entries: list[tuple[int, int, int, int]] = []  # (table row, first position, first step row, count)
    for j, s in enumerate(scheduled):
        entries.append((j, s.start, len(ids), s.count))
        ids += s.seq.tokens(s.start, s.start + s.count)
        positions += range(s.start, s.start + s.count)
        owner += [j] * s.count
        if s.samples:
            sample_rows.append(len(ids) - 1)
    real = len(ids)
    rows, width_max = step_buckets(scheduled, token_sizes, context_sizes)
    pad = rows - real
    ids += [0] * pad
    positions += [0] * pad
    scratch_row = len(scheduled)  # the last table row: all scratch
    owner += [scratch_row] * pad
    if not scheduled:
        entries = [(scratch_row, 0, i, 1) for i in range(rows)]
    by_key: dict[tuple[bool, int], list[tuple[int, int, int, int]]] = {}
    for e in entries:
        by_key.setdefault((e[3] > 1, bucket(e[1] + e[3], context_sizes)), []).append(e)
    keys = sorted(by_key)  # the widest key's width is width_max: a bucket is monotone in the context
    per_row = width_max // BLOCK_TOKENS
    scratch = pool.scratch_block
    table = [s.seq.blocks[:per_row] + [scratch] * (per_row - min(len(s.seq.blocks), per_row)) for s in scheduled]
    table.append([scratch] * per_row)
    blocks = torch.tensor(table, dtype=torch.long)
    token_rows = (blocks[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).reshape(len(table), width_max)
    pos = torch.tensor(positions, dtype=torch.long)
    write = token_rows[torch.tensor(owner, dtype=torch.long)].gather(1, pos[:, None]).squeeze(1)
    out_index = [0] * rows  # padding rows beside requests: any result, not read
    device = pool.device
    groups, offset = [], 0
    for chunked, width in keys:
        members = by_key[chunked, width]
        n = bucket(len(members), token_sizes)
        length = bucket(max(c for *_, c in members), token_sizes) if chunked else 1
        for p, (_, _, row, count) in enumerate(members):
            for q in range(count):
                out_index[row + q] = offset + p * length + q
        members = members + [(scratch_row, 0, 0, 0)] * (n - len(members))  # padding entries: results not read
        # a slot beyond its entry's rows stands at position 0 (one token seen, so no slot is all masked)
        slot_pos = torch.tensor([[x + q if q < c else 0 for q in range(length)] for _, x, _, c in members],
                                dtype=torch.long).view(n, length)
        slot_row = torch.tensor([[r + q if q < c else 0 for q in range(length)] for _, _, r, c in members],
                                dtype=torch.long).view(n, length)
        read = token_rows[torch.tensor([t for t, *_ in members], dtype=torch.long), :width]
        mask = torch.arange(width) <= slot_pos[:, :, None]
        groups.append(AttnGroup(read.to(device), slot_row.to(device), mask.to(device)))
        offset += n * length
    step = ServeStep(pool.storage, torch.tensor(ids, dtype=torch.long).to(device), write.to(device), tuple(groups),
                     torch.tensor(out_index, dtype=torch.long).to(device))
    return BuiltStep(step, real, sample_rows)


def padding_step(pool: BlockPool, shape: tuple[int, tuple[tuple[int, int, int], ...]]) -> ServeStep:
    """A step of ``shape`` (:attr:`ServeStep.shape`) that writes and reads the scratch block alone:
    the static inputs a CUDA graph is captured on (its warm-up runs touch no sequence's K/V)."""
    rows, groups = shape
    if rows < 1 or not groups:
        raise InvalidArgument(f"padding_step: a step shape has rows >= 1 and at least one group, got {shape}")
    device = pool.device
    first = pool.scratch_block * BLOCK_TOKENS
    built = []
    for entries, length, width in groups:
        if entries < 1 or length < 1 or width < 1:
            raise InvalidArgument(f"padding_step: a group has entries, length and width >= 1, got {shape}")
        read = (first + torch.arange(width) % BLOCK_TOKENS).expand(entries, width).contiguous()
        mask = (torch.arange(width) == 0).expand(entries, length, width).contiguous()
        built.append(AttnGroup(read.to(device), torch.zeros(entries, length, dtype=torch.long, device=device),
                               mask.to(device)))
    return ServeStep(pool.storage, torch.zeros(rows, dtype=torch.long, device=device),
                     torch.full((rows,), first, dtype=torch.long, device=device), tuple(built),
                     torch.zeros(rows, dtype=torch.long, device=device))
