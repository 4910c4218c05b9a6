"""A sharded model's planner calls as ops of a graph that torch.compile traces.

Why, in the note below ([Note: the planner's calls as graph ops]): :func:`compiled_block` is what a
block's wrapper (:class:`~wsharding.core.runner.PlannedBlockForward`) runs while it is traced, and
:func:`ensure_in_graph` what a target linear's guard (:mod:`wsharding.core.guards`) runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from wsharding.core.errors import ShardingError
from wsharding.core.planner import WeightShardPlanner

# [Note: the planner's calls as graph ops]
# Traced by torch.compile, a block's planner.block_start / block_end break the graph (the thread check,
# the collectives), and each break leaves a resume function whose guards hold the block's index: one
# graph per layer and, past the recompile limit, the rest of the model eager -- where the replicated
# model is one graph. Under compile the two calls are custom ops instead, opaque to the tracer: each
# names its planner and layer by constants and "mutates" the tensor that orders it -- block_start the
# block's input, so that the block's matmuls (reading its slot) come after the gather is joined;
# block_end the block's output, so that it comes after every op that made it, before the next gather
# into the slot is issued. Nothing is written to either tensor. The step's start and end (the model's
# hooks) still break the graph, outside the layer loop. A block that raises inside a compiled graph
# gives its step up at the model's step end (always called), not in the block. A target linear's own
# check ([Note: checked at use]: ``planner.ensure``) is a third op, ordered by the linear's input.
#: False: the planner's calls are traced as Python, breaking the graph at every block (kept only to show the
#: breaks and the per-layer recompiles it avoids; read when a graph is traced).
enabled = True

_PLANNERS: weakref.WeakValueDictionary[int, WeightShardPlanner] = weakref.WeakValueDictionary()


def register_planner(planner: WeightShardPlanner) -> int:
    """The key by which the compiled graph's ops find ``planner`` ([Note: the planner's calls as graph ops])."""
    _PLANNERS[id(planner)] = planner
    return id(planner)


@torch.library.custom_op("wsharding::block_start", mutates_args=("order",))
def block_start_op(order: torch.Tensor, planner: int, layer: int) -> None:
    """``planner.block_start(layer)`` as one op of a compiled graph; ``order``: the block's input."""
    _PLANNERS[planner].block_start(layer)


@block_start_op.register_fake
def _block_start_fake(order: torch.Tensor, planner: int, layer: int) -> None:
    return None


@torch.library.custom_op("wsharding::block_end", mutates_args=("order",))
def block_end_op(order: torch.Tensor, planner: int, layer: int) -> None:
    """``planner.block_end(layer)`` as one op of a compiled graph; ``order``: the block's output."""
    _PLANNERS[planner].block_end(layer)


@block_end_op.register_fake
def _block_end_fake(order: torch.Tensor, planner: int, layer: int) -> None:
    return None


@torch.library.custom_op("wsharding::ensure", mutates_args=("order",))
def ensure_op(order: torch.Tensor, planner: int, layer: int) -> None:
    """``planner.ensure(layer)`` as one op of a compiled graph; ``order``: the linear's input."""
    _PLANNERS[planner].ensure(layer)


@ensure_op.register_fake
def _ensure_fake(order: torch.Tensor, planner: int, layer: int) -> None:
    return None


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value`` (a tensor, or a tuple / list / dict of them, depth first)."""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for v in items:
        t = first_tensor(v)
        if t is not None:
            return t
    return None


def ensure_in_graph(key: int, layer: int, args: tuple, kwargs: dict) -> None:
    """A target linear's check traced by torch.compile: :func:`ensure_op` ordered by its input."""
    x = first_tensor((args, kwargs))
    if x is None:
        raise ShardingError(f"a sharded linear of layer {layer} under torch.compile was called with no tensor "
                            "argument to order its check by; run the sharded model eagerly")
    ensure_op(x, key, layer)


def compiled_block(inner: Callable[..., Any], key: int, layer: int, args: tuple, kwargs: dict) -> Any:
    """A sharded block traced by torch.compile ([Note: the planner's calls as graph ops])."""
    x = first_tensor((args, kwargs))
    if x is None:
        raise ShardingError(f"block {layer} under torch.compile: it was called with no tensor argument to order its "
                            "gather by; run the sharded model eagerly")
    block_start_op(x, key, layer)
    out = inner(*args, **kwargs)
    y = first_tensor(out)
    block_end_op(x if y is None else y, key, layer)
    return out
