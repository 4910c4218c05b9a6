"""A server's scheduler over a paged KV pool, after vLLM's V1 scheduler: a per-step token budget,
chunked prefill, admission by the scheduled chunk's blocks, growth block by block, preemption by recompute.

Every step (:meth:`Scheduler.schedule`):

1. **Running requests first**, oldest admitted first: each gets the tokens it has left to compute (1
   while it decodes; what is left of its prompt while it prefills), at most what is left of the
   step's token budget -- so a long prompt is prefilled in chunks over several steps, beside the
   decodes. Each takes the blocks its tokens of this step need: a prefill grows chunk by chunk, a
   decode whose next token starts a new block takes one; when they are not free, the **newest**
   running request is preempted: its blocks are freed and it goes back to the front of the waiting
   queue, to be recomputed (prompt and the tokens it generated) when it is admitted again. If the one
   to preempt is the request itself, it stops there.
2. **Then waiting requests**, first come first served, while budget is left and no request was
   preempted this step (vLLM does the same: a step that had to evict does not admit): the head is
   admitted when the blocks of its **first chunk** are free -- the tokens this step schedules for it,
   as vLLM V1 allocates, not its whole prompt -- and its later chunks take their blocks as they are
   scheduled. If they are not free, it waits, and so does everyone behind it -- no overtaking, so a
   long request is not starved.

The output length is the request's (it stops there, as at an end-of-sequence token); the scheduler
never reads it, so it cannot reserve a request's whole footprint as the fixed-row bench did.

A cap on concurrency (``max_concurrency``) stands for the clients of vLLM's ``--max-concurrency``: at
most that many requests are in flight (sent and not finished); an arrived request is sent when one
finishes, and its latencies are counted from then.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from wsharding.core.errors import InvalidArgument
from wsharding.serve.blocks import BLOCK_TOKENS, BlockPool, blocks_for
from wsharding.serve.workload import Request


@dataclass(eq=False)
class Sequence:
    """A request the server has seen: its tokens so far, its blocks, and when things happened."""

    request: Request
    #: When the client sent it: its arrival, or later under a concurrency cap.
    sent_s: float
    generated: list[int] = field(default_factory=list)
    #: Tokens whose K/V are in the pool (0 again after a preemption).
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    #: The time each generated token reached the host.
    token_s: list[float] = field(default_factory=list)
    preempted: int = 0

    @property
    def known(self) -> int:
        """Tokens known: the prompt and what was generated."""
        return len(self.request.prompt) + len(self.generated)

    @property
    def left(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.known - self.computed

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.request.output

    def tokens(self, start: int, stop: int) -> list[int]:
        """Known token ids at positions ``[start, stop)``."""
        prompt = self.request.prompt
        return [prompt[i] if i < len(prompt) else self.generated[i - len(prompt)] for i in range(start, stop)]


@dataclass(frozen=True)
class Scheduled:
    """One request's share of a step: ``count`` tokens from position ``start``; ``samples``: the step
    ends its known tokens, so its last row's logits give the next token."""

    seq: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        return self.start + self.count == self.seq.known


def check_servable(requests: list[Request], pool: BlockPool, max_context: int) -> None:
    """Refuse, before anything runs, a request that could never finish: its whole KV (known to the
    benchmark, not to the scheduler) must fit the pool alone, and its context the widest step."""
    for r in requests:
        if blocks_for(r.kv_tokens) > pool.blocks:
            raise InvalidArgument(
                f"request {r.rid} of rank {r.rank} needs {r.kv_tokens} KV tokens ({len(r.prompt)} prompt + "
                f"{r.output} output - 1), the whole pool holds {pool.tokens} ({pool.blocks} blocks of {BLOCK_TOKENS}): "
                "it could never finish. Give the ranks a larger memory budget or shorten the requests")
        if r.kv_tokens > max_context:
            raise InvalidArgument(f"request {r.rid} of rank {r.rank} needs {r.kv_tokens} KV tokens, a step attends "
                                  f"over at most {max_context}")


class Scheduler:
    """One rank's scheduler: requests not yet arrived, waiting, running, finished."""

    def __init__(self, pool: BlockPool, requests: list[Request], *, token_budget: int, max_seqs: int | None = None,
                 max_concurrency: int | None = None) -> None:
        if token_budget < 1:
            raise InvalidArgument(f"token_budget: need at least 1 token per step, got {token_budget}")
        self.pool, self.token_budget = pool, token_budget
        self.max_seqs = max_seqs or token_budget
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.rid)))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: list[Sequence] = []
        #: Times at which a client slot became free (a cap of n starts with n slots free at 0).
        self._slots: deque[float] | None = None if max_concurrency is None else deque([0.0] * max_concurrency)
        self.preemptions = 0
        #: Tokens whose K/V a preemption threw away: computed again when the request is readmitted.
        self.recomputed_tokens = 0
        #: Requests that, arrived, waited at least once because the head of the queue's blocks were not free.
        self.waited_for_memory: set[int] = set()

    @property
    def in_flight(self) -> int:
        """Requests sent and not finished: waiting in the server or running."""
        return len(self.waiting) + len(self.running)

    def next_arrival(self) -> float | None:
        """When the next request not yet sent arrives (None: none left, or every client slot busy)."""
        if not self.pending or (self._slots is not None and not self._slots):
            return None
        return self.pending[0].arrival_s

    def has_work(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    def ready_at(self) -> float:
        """When this rank next has something to compute (seconds since the start): 0.0 with requests sent
        and not finished, else its next arrival, else +inf (nothing left). Work with no arrival to wait
        for is 0.0 too: a step, not a wait that would never end, shows the stall. Aligned ranks step from
        the earliest rank's (:func:`~wsharding.serve.engine.serve`)."""
        if self.waiting or self.running:
            return 0.0
        if not self.pending:
            return math.inf
        nxt = self.next_arrival()
        return 0.0 if nxt is None else nxt

    def _send_arrived(self, now: float) -> None:
        while self.pending and self.pending[0].arrival_s <= now:
            r = self.pending[0]
            if self._slots is None:
                sent = r.arrival_s
            elif self._slots:
                sent = max(r.arrival_s, self._slots.popleft())
            else:
                break  # every client slot in flight: it waits on the client side
            self.pending.popleft()
            self.waiting.append(Sequence(r, sent_s=sent))

    def _preempt(self, seq: Sequence) -> None:
        self.pool.give_back(seq.blocks)
        self.recomputed_tokens += seq.computed
        seq.blocks, seq.computed = [], 0
        seq.preempted += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self, now: float) -> list[Scheduled]:
        """The step at time ``now`` (seconds since the start): which requests compute which tokens.
        Blocks are taken here; :meth:`step_done` advances the requests."""
        self._send_arrived(now)
        budget = self.token_budget
        out: list[Scheduled] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            count = min(seq.left, budget)
            # the blocks this step's tokens need beyond those held (a request holds its computed tokens'
            # blocks; the floor keeps the ask >= 0 should it ever hold more)
            need = max(0, blocks_for(seq.computed + count) - len(seq.blocks))
            itself = False
            while need > self.pool.free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                itself = victim is seq
                if itself:
                    break
            if itself:
                break
            seq.blocks += self.pool.take(need)
            out.append(Scheduled(seq, seq.computed, count))
            budget -= count
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            count = min(seq.left, budget)
            need = blocks_for(count)  # the first chunk's blocks (vLLM V1), not the whole prompt's
            if need > self.pool.free_blocks:
                self.waited_for_memory.update(s.request.rid for s in self.waiting)
                break
            self.waiting.popleft()
            seq.blocks = self.pool.take(need)
            self.running.append(seq)
            out.append(Scheduled(seq, 0, count))
            budget -= count
        return out

    def step_done(self, scheduled: list[Scheduled], sampled: list[int], now: float) -> None:
        """Advance the step's requests: ``sampled[j]`` is the next token of the j-th request of
        ``scheduled`` that samples. A finished request gives its blocks back and frees a client slot."""
        tokens = iter(sampled)
        for s in scheduled:
            seq = s.seq
            seq.computed += s.count
            if not s.samples:
                continue
            seq.generated.append(next(tokens))
            seq.token_s.append(now)
            if seq.done:
                self.pool.give_back(seq.blocks)
                seq.blocks = []
                self.running.remove(seq)
                self.finished.append(seq)
                if self._slots is not None:
                    self._slots.append(now)
