"""wsharding: weight sharding for LLM inference.

Every rank of a group stores 1/N of the weights that would otherwise be replicated on each GPU; one
AllGather per layer rebuilds the layer's weights, into one of two slots, just before it computes.
Storage is sharded; compute is not: outputs are bit-identical to the replicated model.

Where to start:

* ``init_from_env()`` -- in a ``torchrun`` job, the rank's context; ``ctx.shard_comm(n)`` is the
  communicator of its shard group (n ranks inside one node).
* ``shard_blocks(model, "layers", ["attn.*_proj"], comm)`` -- shard a model that is already built
  with its weights; returns the ``WeightSharding`` that owns the shards, the slots and the planner.
* ``load_sharded(build, checkpoint, "layers", patterns, comm)`` -- build-then-load without ever
  holding the replicated weights: ``build`` runs inside ``empty_parameters()`` (every parameter on
  meta), and each rank reads only its rows of a safetensors checkpoint; ``ws.model`` is the model.
* ``WeightSharding`` -- the lifecycle underneath (declare, load, finalize, close), for models whose
  layers call the planner themselves; ``FlatLayout`` -- one layer's weights as one flat byte buffer.

Every error the package raises derives from ``WshardingError``.

How it is built: ``wsharding.core`` holds the whole mechanism and reads alone (``help(wsharding.core)``
gives the reading order); ``wsharding.accel`` holds the accelerations, passed in as objects -- our NCCL
communicator (``wsharding.accel.nccl.from_context``), the slot layout it offers (``map_own_chunk``),
planner plug-ins (``shard_blocks(..., plugins=[NextStepPrefetch()])``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below, for type checkers and editors; at run time ``__getattr__`` imports them
    from wsharding.checkpoint import BuiltWholeWarning, CheckpointError, load_checkpoint, load_sharded, save_checkpoint
    from wsharding.core.comm import CommError
    from wsharding.core.context import ClusterError, RankContext, init_from_env
    from wsharding.core.declare import ShardingSkipWarning, UnmatchedPatternWarning
    from wsharding.core.errors import InvalidArgument, InvalidType, NotFound, ShardingError, Unsupported, WshardingError
    from wsharding.core.groups import ShardGroupAcrossNodesWarning
    from wsharding.core.layout import FlatLayout, LayoutEntry, LayoutError, OwnedPiece
    from wsharding.core.runner import shard_blocks
    from wsharding.core.sharding import WeightSharding
    from wsharding.empty_build import empty_parameters

# [Note: the package face imports nothing until asked]
# Every name below is imported from its module the first time it is read (PEP 562), not when the package
# is. Importing any module of the package runs this file first, and the command's ``--help`` and its
# argument errors must answer without loading torch (about 2 s, most of the command's start-up): so this
# file imports nothing of the package itself.
_HOME: dict[str, str] = {
    "BuiltWholeWarning": "wsharding.checkpoint",
    "CheckpointError": "wsharding.checkpoint",
    "load_checkpoint": "wsharding.checkpoint",
    "load_sharded": "wsharding.checkpoint",
    "save_checkpoint": "wsharding.checkpoint",
    "CommError": "wsharding.core.comm",
    "ClusterError": "wsharding.core.context",
    "RankContext": "wsharding.core.context",
    "init_from_env": "wsharding.core.context",
    "ShardingSkipWarning": "wsharding.core.declare",
    "UnmatchedPatternWarning": "wsharding.core.declare",
    "InvalidArgument": "wsharding.core.errors",
    "InvalidType": "wsharding.core.errors",
    "NotFound": "wsharding.core.errors",
    "ShardingError": "wsharding.core.errors",
    "Unsupported": "wsharding.core.errors",
    "WshardingError": "wsharding.core.errors",
    "ShardGroupAcrossNodesWarning": "wsharding.core.groups",
    "FlatLayout": "wsharding.core.layout",
    "LayoutEntry": "wsharding.core.layout",
    "LayoutError": "wsharding.core.layout",
    "OwnedPiece": "wsharding.core.layout",
    "shard_blocks": "wsharding.core.runner",
    "WeightSharding": "wsharding.core.sharding",
    "empty_parameters": "wsharding.empty_build",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        # a subpackage read as an attribute (``help(wsharding.core)``), as when this file imported it
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module 'wsharding' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next read is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__version__ = "0.1.0"
__all__ = [
    "BuiltWholeWarning",
    "CheckpointError",
    "ClusterError",
    "CommError",
    "InvalidArgument",
    "InvalidType",
    "NotFound",
    "Unsupported",
    "WshardingError",
    "FlatLayout",
    "LayoutEntry",
    "LayoutError",
    "OwnedPiece",
    "RankContext",
    "ShardGroupAcrossNodesWarning",
    "ShardingError",
    "ShardingSkipWarning",
    "UnmatchedPatternWarning",
    "WeightSharding",
    "__version__",
    "empty_parameters",
    "init_from_env",
    "load_checkpoint",
    "load_sharded",
    "save_checkpoint",
    "shard_blocks",
]
