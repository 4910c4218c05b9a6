"""Serve a stream of requests on one rank, greedy decoding, and measure what a user would see.

Every rank runs every step, working or not: a sharded model gathers its weights in every forward, and
a rank that skipped one would leave the others waiting in that gather. A rank with nothing to do runs
an all-padding step (the dummy step). The ranks stop together when none has work left, which they
agree on after every step (``agree``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.errors import WshardingError
from wsharding.models.token_pool import TokenKVPool
from wsharding.serve.batcher import ContinuousBatcher
from wsharding.serve.workload import Request


class ServeStalled(WshardingError, RuntimeError):
    """The step loop ran ``max_steps`` steps and some rank still had work."""


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` by nearest rank (the smallest value with at least q % of the
    values at or below it); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class ServeRun:
    """One rank's run of one model variant."""

    steps: int
    wall_s: float
    outputs: dict[int, list[int]]
    ttft_s: list[float]
    tpot_s: list[float]
    concurrency: list[int]
    waited_for_memory: int
    waited_for_rows: int
    pool_tokens: int
    #: The most KV tokens in use at once.
    peak_kv_tokens: int

    def summary(self) -> dict[str, Any]:
        tokens = sum(len(v) for v in self.outputs.values())
        ms = [1e3 * x for x in self.ttft_s], [1e3 * x for x in self.tpot_s]
        return {
            "steps": self.steps, "wall_s": self.wall_s, "output_tokens": tokens,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "tokens_per_step": tokens / self.steps if self.steps else 0.0,
            "max_concurrency": max(self.concurrency, default=0),
            "mean_concurrency": statistics.fmean(self.concurrency) if self.concurrency else 0.0,
            "ttft_ms_median": statistics.median(ms[0]) if ms[0] else None, "ttft_ms_p99": percentile(ms[0], 99),
            "tpot_ms_median": statistics.median(ms[1]) if ms[1] else None, "tpot_ms_p99": percentile(ms[1], 99),
            "waited_for_memory": self.waited_for_memory, "waited_for_rows": self.waited_for_rows,
            "pool_tokens": self.pool_tokens, "peak_kv_tokens": self.peak_kv_tokens,
        }


def serve(model: torch.nn.Module, pool: TokenKVPool, requests: list[Request], *, rows: int, max_len: int,
          agree: Callable[[bool], bool] = bool, clock: Callable[[], float] = time.perf_counter,
          warmup: int = 1, max_steps: int = 1_000_000) -> ServeRun:
    """Serve ``requests`` (this rank's) with ``model.forward_serve`` until no rank has work left.

    ``agree(has_work)`` returns whether any rank still has work (all ranks call it after every step;
    ``bool`` for a single rank). Times are seconds since the start; a request's TTFT runs from its
    arrival to its first token, its TPOT is the mean time between its later tokens. ``warmup`` all-padding
    steps run first, untimed (the first forward of a process pays one-time set-up costs).
    """
    device = pool.k.device
    batcher = ContinuousBatcher(pool, requests, rows=rows, max_len=max_len, device=device)
    steps, peak_used = 0, 0
    with torch.no_grad():
        idle = ContinuousBatcher(pool, [], rows=rows, max_len=max_len, device=device)
        for _ in range(warmup):
            model.forward_serve(idle.next_step(0.0)).argmax(-1).tolist()
    t0 = clock()
    with torch.no_grad():
        while True:
            step = batcher.next_step(clock() - t0)
            peak_used = max(peak_used, pool.used_tokens)
            chosen = model.forward_serve(step).argmax(-1).tolist()  # the host needs them: a sync per step
            batcher.step_done(chosen, clock() - t0)
            steps += 1
            if not agree(batcher.has_work()):
                break
            if steps >= max_steps:
                raise ServeStalled(f"serve: still working after {max_steps} steps on rank "
                                   f"{requests[0].rank if requests else '?'}; something never finishes")
    wall = clock() - t0
    done = batcher.finished
    ttft = [s.first_token_s - s.request.arrival_s for s in done]
    tpot = [(s.done_s - s.first_token_s) / (s.request.output - 1) for s in done if s.request.output > 1]
    return ServeRun(steps=steps, wall_s=wall, outputs={s.request.rid: s.generated for s in done}, ttft_s=ttft,
                    tpot_s=tpot, concurrency=batcher.concurrency, waited_for_memory=len(batcher.waited_for_memory),
                    waited_for_rows=len(batcher.waited_for_rows), pool_tokens=pool.tokens, peak_kv_tokens=peak_used)
