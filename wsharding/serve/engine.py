"""Serve a stream of requests on one rank, greedy decoding, and record what a user would see.

Two ways to run, as the two variants need:

* **free** (``agree=None``, a replicated model): the rank serves its own requests and nothing else;
  with nothing to compute it waits for the next arrival (no step runs), and it stops when its own
  work is done -- as every replica of a replicated deployment does.
* **aligned** (``agree`` given, a sharded model): every rank runs every step, working or not: a
  sharded model gathers its weights in every forward, and a rank that skipped one would leave the
  others waiting in that gather. Before every step the ranks agree (``agree``) on when the earliest
  of them has something to compute: while one has, a rank with nothing to do runs a one-token
  padding step (an **idle step**, counted); while none has, none steps -- they all wait for the
  earliest next arrival; with nothing left on any rank they stop together.

What is recorded: per request, when it arrived, when it was sent, the time each token reached the
host (TTFT, ITL, TPOT and end-to-end latency follow, :mod:`wsharding.serve.metrics`); per step, its
tokens, its buckets, its time, the KV blocks in use and the requests in flight; and the time each
step was scheduled, which is all a replay needs to make the same decisions again ([Note: bits
across buckets] in :mod:`wsharding.serve.step`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from wsharding.core.errors import WshardingError
from wsharding.serve.blocks import BlockPool
from wsharding.serve.scheduler import Scheduler, Sequence, check_servable
from wsharding.serve.step import build_step, context_buckets, token_buckets
from wsharding.serve.workload import Request


class ServeStalled(WshardingError, RuntimeError):
    """The step loop can make no progress: a rank with requests sent scheduled none, or ``max_steps``
    steps ran and some rank still had work."""


@dataclass
class ServeRun:
    """One rank's run of one model variant on one workload."""

    outputs: dict[int, list[int]]
    #: Per request (in rid order): times in seconds since the start, lengths, preemptions.
    records: list[dict[str, Any]]
    #: Per step: real tokens, token bucket, context bucket, requests, seconds (host clock, end to end).
    step_tokens: list[int] = field(default_factory=list)
    step_bucket: list[int] = field(default_factory=list)
    step_context: list[int] = field(default_factory=list)
    step_requests: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    #: When each step was scheduled (seconds since the start): a replay's clock.
    schedule_times: list[float] = field(default_factory=list)
    #: Per step: KV blocks in use once the step was scheduled, requests in flight (sent, not finished).
    step_blocks: list[int] = field(default_factory=list)
    step_in_flight: list[int] = field(default_factory=list)
    pool_blocks: int = 0
    peak_blocks: int = 0
    peak_in_flight: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    waited_for_memory: int = 0
    #: Steps that computed nothing (an aligned rank pads with them while another rank computes; a free rank runs none).
    idle_steps: int = 0
    wall_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.step_tokens)


def record(seq: Sequence) -> dict[str, Any]:
    """One finished request's record: when it arrived and was sent, its lengths, the time each token
    reached the host, its preemptions (what :mod:`~wsharding.serve.metrics` reads; a replay of the
    scheduler writes the same)."""
    r = seq.request
    return {"rid": r.rid, "rank": r.rank, "arrival_s": r.arrival_s, "sent_s": seq.sent_s, "prompt_tokens": len(r.prompt),
            "output_tokens": len(seq.generated), "token_s": list(seq.token_s), "preempted": seq.preempted}


def serve(model: torch.nn.Module, pool: BlockPool, requests: list[Request], *, token_budget: int,
          max_context: int, max_seqs: int | None = None, max_concurrency: int | None = None,
          agree: Callable[[float], float] | None = None, clock: Callable[[], float] = time.perf_counter,
          warmup: int = 1, max_steps: int = 1_000_000, schedule_times: list[float] | None = None,
          pad_to: int | None = None, runner: Callable[[Any], torch.Tensor] | None = None) -> ServeRun:
    """Serve ``requests`` (this rank's) with ``model.forward_serve``.

    ``agree``: None runs **free** (no idle steps: with nothing to compute the rank waits for the next
    arrival; it stops when its own work is done); given, the ranks run **aligned** steps --
    ``agree(ready_at)`` takes when this rank next has something to compute
    (:meth:`~wsharding.serve.scheduler.Scheduler.ready_at`: 0.0 now, an arrival time, +inf never;
    seconds since this rank's start) and returns the minimum over the ranks. Every rank calls it once
    before every step and once more to stop: +inf stops every rank; otherwise each waits until then
    and steps, a rank with nothing to do running an idle step. A request's times run from when it is sent
    (:mod:`~wsharding.serve.scheduler`). ``warmup`` padding steps of every token bucket run first,
    untimed (a process's first forward of a shape pays one-time costs). ``schedule_times``: replay --
    step i is scheduled as if at that time, and exactly that many steps run, then idle steps up to
    ``pad_to`` steps in all (ranks replaying schedules of other lengths stay aligned so).
    ``runner``: runs each built step and returns its logits (a :class:`~wsharding.serve.runner.StepRunner`
    replays captured CUDA graphs); default ``model.forward_serve`` of the step, eagerly.
    """
    check_servable(requests, pool, max_context)
    sched = Scheduler(pool, requests, token_budget=token_budget, max_seqs=max_seqs, max_concurrency=max_concurrency)
    sizes, widths = token_buckets(token_budget), context_buckets(max_context)
    run = ServeRun(outputs={}, records=[], pool_blocks=pool.blocks)
    replay = schedule_times is not None
    total = None if not replay else max(len(schedule_times), pad_to or 0)
    with torch.no_grad():
        for _ in range(warmup):
            for n in sizes:  # every shape once; the contents are padding
                idle = build_step(pool, [], [n], widths)
                model.forward_serve(idle.step).argmax(-1).tolist()
    aligned = agree is not None and not replay
    t0 = clock()
    with torch.no_grad():
        while True:
            if replay and run.steps == total:
                break
            if aligned:
                # Step or stop is decided from the agreed time alone, never from a rank's own clock (the
                # ranks' clocks start apart): a rank that waited and agreed again while another stepped
                # would meet the other's gathers with an all-reduce. So after a wait every rank steps --
                # the earliest rank's arrival has come -- and every rank calls agree once per step.
                ready = agree(sched.ready_at())
                if ready == math.inf:
                    break
                if ready > 0.0:
                    time.sleep(max(0.0, ready - (clock() - t0)))  # no rank has work before then: no idle steps
            began = clock()
            if replay:
                padding = run.steps >= len(schedule_times)
                now = schedule_times[-1] if padding else schedule_times[run.steps]
                scheduled = [] if padding else sched.schedule(now)
            else:
                now = began - t0
                scheduled = sched.schedule(now)
                if not scheduled and agree is None:
                    if not sched.has_work():
                        break
                    nxt = sched.next_arrival()
                    if nxt is None:
                        raise ServeStalled(f"serve: nothing to schedule on rank {requests[0].rank} and no arrival "
                                           f"to wait for: {len(sched.waiting)} waiting, {len(sched.running)} running")
                    time.sleep(max(0.0, nxt - (clock() - t0)))  # a free rank waits; it runs no idle step
                    continue
                if not scheduled and (sched.waiting or sched.running):
                    # An aligned rank with requests sent and none scheduled: every request fits the pool
                    # alone (checked above) and nothing else would free blocks or budget for them, so its
                    # padding steps would go on to max_steps. Said now; its peers then meet a missing
                    # rank in their next agreement or gather (the collective timeout), not a silent spin.
                    raise ServeStalled(f"serve: rank {requests[0].rank} scheduled nothing with "
                                       f"{len(sched.waiting)} waiting and {len(sched.running)} running "
                                       f"(step {run.steps}): the scheduler can make no progress")
            run.peak_blocks = max(run.peak_blocks, pool.used_blocks)
            run.step_blocks.append(pool.used_blocks)
            run.step_in_flight.append(sched.in_flight)
            built = build_step(pool, scheduled, sizes, widths)
            logits = runner(built) if runner is not None else model.forward_serve(built.step)
            # the host needs the tokens to build the next step: one sync per step, as a server has
            sampled = logits[built.sample_rows].argmax(-1).tolist() if built.sample_rows else []
            ended = clock()
            sched.step_done(scheduled, sampled, ended - t0)
            run.schedule_times.append(now)
            run.step_tokens.append(built.tokens)
            run.step_bucket.append(built.bucket_tokens)
            run.step_context.append(built.bucket_context)
            run.step_requests.append(len(scheduled))
            run.step_s.append(ended - began)
            run.idle_steps += not scheduled
            if not replay and agree is None and not sched.has_work():
                break
            if run.steps >= max_steps:
                raise ServeStalled(f"serve: still working after {max_steps} steps on rank "
                                   f"{requests[0].rank if requests else '?'}: {len(sched.running)} running, "
                                   f"{len(sched.waiting)} waiting, {len(sched.pending)} not arrived")
    run.wall_s = clock() - t0
    done = sorted(sched.finished, key=lambda s: s.request.rid)
    run.outputs = {s.request.rid: s.generated for s in done}
    run.records = [record(s) for s in done]
    run.preemptions = sched.preemptions
    run.recomputed_tokens = sched.recomputed_tokens
    run.waited_for_memory = len(sched.waited_for_memory)
    run.peak_in_flight = max(run.step_in_flight, default=0)
    return run
