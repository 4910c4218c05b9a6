"""Continuous batching over a token KV pool: prompts join a step, finished sequences leave, a request
that does not fit waits.

Admission is first come, first served: the oldest arrived request is admitted when its whole KV
footprint (:attr:`~wsharding.serve.workload.Request.kv_tokens`) is free in the pool and its prompt
fits in the step's rows; otherwise it waits, and so does every request behind it (no overtaking, so
a long request is not starved). Reserving the whole footprint at admission means a running sequence
never has to be evicted: the pool can never be over-committed.

Each step is a :class:`~wsharding.models.token_pool.ServeStep` of a fixed number of rows: one row per
running sequence (its last token), then the prompts admitted this step, then padding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from wsharding.core.errors import InvalidArgument
from wsharding.models.token_pool import ServeStep, TokenKVPool
from wsharding.serve.workload import Request


@dataclass
class Sequence:
    """A request admitted into the pool."""

    request: Request
    rows: list[int]
    #: The pool rows this sequence reads, padded with the scratch row to the step's width (on the device).
    read_row: torch.Tensor
    generated: list[int] = field(default_factory=list)
    #: Tokens whose K/V are in the pool.
    written: int = 0
    admitted_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.output


def check_fits(requests: list[Request], pool: TokenKVPool, rows: int, max_len: int) -> None:
    """Refuse, before anything runs, a request that could never be admitted (it would wait forever)."""
    for r in requests:
        if r.kv_tokens > pool.tokens:
            raise InvalidArgument(
                f"request {r.rid} of rank {r.rank} needs {r.kv_tokens} KV tokens ({len(r.prompt)} prompt + "
                f"{r.output} output - 1), the whole pool holds {pool.tokens}: it could never be admitted. "
                "Give the ranks a larger memory budget or shorten the requests")
        if len(r.prompt) > rows:
            raise InvalidArgument(f"request {r.rid} of rank {r.rank}: its prompt of {len(r.prompt)} tokens does not "
                                  f"fit in a step of {rows} rows; raise the step's rows")
        if r.kv_tokens > max_len:
            raise InvalidArgument(f"request {r.rid} of rank {r.rank} needs {r.kv_tokens} KV tokens, a step attends "
                                  f"over at most {max_len}; raise max_len")


class ContinuousBatcher:
    """One rank's scheduler: waiting requests, running sequences, and the step they make."""

    def __init__(self, pool: TokenKVPool, requests: list[Request], *, rows: int, max_len: int,
                 device: torch.device | str) -> None:
        check_fits(requests, pool, rows, max_len)
        self.pool, self.rows, self.max_len, self.device = pool, rows, max_len, torch.device(device)
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.rid)))
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        #: Requests that, arrived, were held back at least once because the pool had too little free KV
        #: for the oldest waiting request (or, the second set, because its prompt did not fit in the step).
        self.waited_for_memory: set[int] = set()
        self.waited_for_rows: set[int] = set()
        #: Running sequences (including those admitted this step) at each step.
        self.concurrency: list[int] = []
        self._scratch_row = torch.full((max_len,), pool.scratch, dtype=torch.long, device=self.device)
        self._positions = torch.arange(max_len, device=self.device)
        self._layout: list[tuple[Sequence, int, int]] = []  # (sequence, first row, rows) of the step

    def has_work(self) -> bool:
        return bool(self.pending or self.running)

    def _admit(self, now: float, free_rows: int) -> list[Sequence]:
        admitted = []
        while self.pending and self.pending[0].arrival_s <= now:
            r = self.pending[0]
            if r.kv_tokens > self.pool.free_tokens or len(r.prompt) > free_rows:
                # The head waits, and every arrived request behind it waits with it.
                why = self.waited_for_memory if r.kv_tokens > self.pool.free_tokens else self.waited_for_rows
                why.update(q.rid for q in self.pending if q.arrival_s <= now)
                break
            self.pending.popleft()
            rows = self.pool.take(r.kv_tokens)
            read = self._scratch_row.clone()
            read[: len(rows)] = torch.tensor(rows, dtype=torch.long, device=self.device)
            admitted.append(Sequence(r, rows, read, admitted_s=now))
            free_rows -= len(r.prompt)
        return admitted

    def next_step(self, now: float) -> ServeStep:
        """Admit what fits at time ``now`` (seconds since the start) and lay out the step's rows."""
        decoding = list(self.running)
        admitted = self._admit(now, self.rows - len(decoding))
        self.running.extend(admitted)
        self.concurrency.append(len(self.running))
        tokens, positions, owner, layout = [], [], [], []
        for i, s in enumerate(decoding):  # one row each: the last generated token, at the next position
            layout.append((s, len(tokens), 1))
            tokens.append(s.generated[-1])
            positions.append(s.written)
            owner.append(i)
        for j, s in enumerate(admitted, start=len(decoding)):
            layout.append((s, len(tokens), len(s.request.prompt)))
            tokens.extend(s.request.prompt)
            positions.extend(range(len(s.request.prompt)))
            owner.extend([j] * len(s.request.prompt))
        pad = self.rows - len(tokens)
        scratch = len(decoding) + len(admitted)
        tokens += [0] * pad
        positions += [0] * pad
        owner += [scratch] * pad
        table = torch.stack([s.read_row for s in decoding + admitted] + [self._scratch_row])
        read = table[torch.tensor(owner, dtype=torch.long, device=self.device)]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        self._layout = layout
        return ServeStep(self.pool, torch.tensor(tokens, dtype=torch.long, device=self.device),
                         write=read.gather(1, pos[:, None]).squeeze(1), read=read,
                         mask=self._positions[None, :] <= pos[:, None])

    def step_done(self, next_tokens: list[int], now: float) -> None:
        """Take each sequence's next token from the step's greedy choices (``next_tokens[row]``); finished
        sequences leave and give their KV back."""
        for s, first, count in self._layout:
            s.written += count
            s.generated.append(next_tokens[first + count - 1])
            if s.first_token_s is None:
                s.first_token_s = now
            if s.done:
                s.done_s = now
                self.pool.give_back(s.rows)
        self.finished.extend(s for s in self.running if s.done)
        self.running = [s for s in self.running if not s.done]
        self._layout = []
