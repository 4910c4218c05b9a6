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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wsharding.serve.blocks import BLOCK_TOKENS, BlockPool, blocks_for
    from wsharding.serve.budget import activation_reserve_bytes, budget_for_share, budget_from_device, pool_blocks
    from wsharding.serve.engine import ServeRun, serve
    from wsharding.serve.scheduler import Scheduler, check_servable
    from wsharding.serve.workload import Request, Workload

#: Each name's module, imported the first time the name is read ([Note: the package face imports nothing
#: until asked] in :mod:`wsharding`): ``--slo`` is parsed with :mod:`wsharding.serve.metrics` (no torch),
#: which runs this file first.
_HOME: dict[str, str] = {
    "BLOCK_TOKENS": "wsharding.serve.blocks", "BlockPool": "wsharding.serve.blocks", "blocks_for": "wsharding.serve.blocks",
    "activation_reserve_bytes": "wsharding.serve.budget", "budget_for_share": "wsharding.serve.budget",
    "budget_from_device": "wsharding.serve.budget", "pool_blocks": "wsharding.serve.budget",
    "ServeRun": "wsharding.serve.engine", "serve": "wsharding.serve.engine",
    "Scheduler": "wsharding.serve.scheduler", "check_servable": "wsharding.serve.scheduler",
    "Request": "wsharding.serve.workload", "Workload": "wsharding.serve.workload",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'wsharding.serve' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = ["BLOCK_TOKENS", "BlockPool", "Request", "Scheduler", "ServeRun", "Workload", "activation_reserve_bytes",
           "blocks_for", "budget_for_share", "budget_from_device", "check_servable", "pool_blocks", "serve"]
