"""Serving a stream of requests, to measure what weight sharding's saving buys.

Weight sharding frees memory, not FLOPs: it pays when the freed bytes become KV cache, and the KV
cache becomes more requests served at once -- if the gathers it adds do not cost more than that.
This package serves the way a server does, on each rank, in reading order:

* :mod:`~wsharding.serve.workload` -- a seeded stream of requests per rank (:class:`Workload`, :class:`Request`);
* :mod:`~wsharding.serve.budget` -- the KV pool a memory budget leaves (:func:`pool_blocks`);
* :mod:`~wsharding.serve.blocks` -- a paged KV pool, blocks of 16 tokens (:class:`BlockPool`);
* :mod:`~wsharding.serve.scheduler` -- token budget, chunked prefill, preemption by recompute (:class:`Scheduler`);
* :mod:`~wsharding.serve.step` -- a step of the tokens it has, bucketed (:func:`build_step`);
* :mod:`~wsharding.serve.engine` -- the step loop, greedy decoding, replay (:func:`serve`, :class:`ServeRun`);
* :mod:`~wsharding.serve.metrics` -- TTFT, TPOT, ITL, E2E, goodput under SLOs, intervals over trials.

The model side is :class:`~wsharding.models.serve_step.ServeStep` and ``ToyDecoder.forward_serve``.
``wsharding bench serve`` runs it for the replicated and the sharded model side by side.
"""

from wsharding.serve.blocks import BLOCK_TOKENS, BlockPool, blocks_for
from wsharding.serve.budget import (
    activation_reserve_bytes,
    budget_for_share,
    budget_from_device,
    pool_blocks,
)
from wsharding.serve.engine import ServeRun, serve
from wsharding.serve.scheduler import Scheduler, check_servable
from wsharding.serve.workload import Request, Workload

__all__ = ["BLOCK_TOKENS", "BlockPool", "Request", "Scheduler", "ServeRun", "Workload", "activation_reserve_bytes",
           "blocks_for", "budget_for_share", "budget_from_device", "check_servable", "pool_blocks", "serve"]
