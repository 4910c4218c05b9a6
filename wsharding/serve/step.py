"""One forward of the scheduler's step: the tokens it has, rounded up to a bucket, attending over the
context they have, rounded up to a bucket.

A server runs a step of T tokens as one of a few captured shapes (vLLM captures CUDA graphs for a
list of batch sizes and pads a step up to the next one). Here the token buckets are 1, 2, 4, 8, ...
up to the step's token budget (and the budget itself): a step costs what its tokens cost, padded by
less than 2x, never a fixed row count. Attention needs a fixed width too: every row of the step reads
its sequence's block table up to the step's **context bucket** (16, 32, 64, ... tokens, at least the
longest context in the step), masked beyond its own position -- so a step of short sequences attends
over a short window. (A paged-attention kernel would read each sequence's own length; one width per
step is the closest plain ``scaled_dot_product_attention`` gets.) Each row also gathers its own copy of
its sequence's K/V (``ServeStep.gathered``): a prefill chunk of c rows reads its context c times, where
a paged-attention kernel reads it once. So prefill steps cost more here than in a server, and a gather
hides behind them more easily than it would there; decode steps (one row per sequence) are not affected.

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
    rank with nothing to do still runs every step: its gathers pair with the other ranks')."""
    ids: list[int] = []
    positions: list[int] = []
    owner: list[int] = []
    sample_rows: list[int] = []
    for j, s in enumerate(scheduled):
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
    owner += [len(scheduled)] * pad  # the last table row: all scratch
    per_row = width // BLOCK_TOKENS
    scratch = pool.scratch_block
    table = [s.seq.blocks[:per_row] + [scratch] * (per_row - min(len(s.seq.blocks), per_row)) for s in scheduled]
    table.append([scratch] * per_row)
    device = pool.device
    blocks = torch.tensor(table, dtype=torch.long)
    token_rows = (blocks[:, :, None] * BLOCK_TOKENS + torch.arange(BLOCK_TOKENS)).reshape(len(table), width)
    pos = torch.tensor(positions, dtype=torch.long)
    read = token_rows[torch.tensor(owner, dtype=torch.long)]
    write = read.gather(1, pos[:, None]).squeeze(1)
    mask = torch.arange(width)[None, :] <= pos[:, None]
    step = ServeStep(pool.storage, torch.tensor(ids, dtype=torch.long).to(device), write=write.to(device),
                     read=read.to(device), mask=mask.to(device))
    return BuiltStep(step, real, sample_rows)
