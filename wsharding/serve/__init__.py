"""Serving a stream of requests, to measure what weight sharding's saving buys.

Weight sharding frees memory, not FLOPs: it pays when the freed bytes become KV cache, and the KV
cache becomes more requests served at once. This package runs that end to end on each rank, in
reading order:

* :mod:`~wsharding.serve.workload` -- a seeded stream of requests per rank (:class:`Workload`, :class:`Request`);
* :mod:`~wsharding.serve.budget` -- the KV pool a memory budget leaves (:func:`pool_tokens`);
* :mod:`~wsharding.serve.batcher` -- continuous batching over a token KV pool (:class:`ContinuousBatcher`);
* :mod:`~wsharding.serve.engine` -- the step loop, greedy decoding and the user's view (:func:`serve`, :class:`ServeRun`).

The model side is :class:`~wsharding.models.token_pool.TokenKVPool` and ``ToyDecoder.forward_serve``.
``wsharding bench serve`` runs it for the replicated and the sharded model side by side.
"""

from wsharding.serve.batcher import ContinuousBatcher, check_fits
from wsharding.serve.budget import activation_reserve_bytes, pool_tokens
from wsharding.serve.engine import ServeRun, serve
from wsharding.serve.workload import Request, Workload

__all__ = ["ContinuousBatcher", "Request", "ServeRun", "Workload", "activation_reserve_bytes", "check_fits",
           "pool_tokens", "serve"]
