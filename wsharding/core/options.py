"""The options of a sharding, as one frozen value checked once.

``shard_blocks`` and ``WeightSharding`` keep their keyword arguments for their users and build a
:class:`ShardingOptions` from them; from there on the sharding and its planner read this one value,
so no option is threaded by hand through a signature or checked twice.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from wsharding.core.errors import ShardingError, require_bool
from wsharding.core.plugins import PlannerPlugin, check_plugins
from wsharding.core.schedule import check_depth


def layer_indices(sharded_layers: Iterable[int] | None) -> list[int] | None:
    """``sharded_layers`` as a list of layer indices, or None for every layer. A float, a bool or a
    single int would otherwise be read as no layer at all (a set of floats matches no layer id)."""
    if sharded_layers is None:
        return None
    example = "e.g. [1, 2] or range(1, 8)"
    if isinstance(sharded_layers, (str, bytes)) or not isinstance(sharded_layers, Iterable):
        raise ShardingError(f"sharded_layers: got the {type(sharded_layers).__name__} {sharded_layers!r}; pass the "
                            f"layer indices as a list or range, {example}"
                            + (f" ([{sharded_layers}] for that one layer)" if isinstance(sharded_layers, int) else ""))
    layer_ids = []
    for i in sharded_layers:
        try:
            layer_ids.append(operator.index(i) if not isinstance(i, bool) else None)
        except TypeError:
            layer_ids.append(None)
        if layer_ids[-1] is None:
            raise ShardingError(f"sharded_layers: {i!r} (a {type(i).__name__}) is not a layer index; pass whole "
                                f"numbers, {example}")
    return layer_ids


ON_MISS = ("gather", "raise")
MAP_OWN_CHUNK = (True, False, "auto")


@dataclass(frozen=True)
class ShardingOptions:
    """How a model is sharded; each option's meaning is in :class:`~wsharding.core.sharding.WeightSharding`.

    Checked here, once, as it is made: a bad value raises the package's error naming the option and
    what to pass."""

    #: The layers that may be sharded (None: every layer); kept as a tuple of indices.
    sharded_layers: Iterable[int] | None = None
    lookahead: bool = True
    trace: bool = False
    keep_initial_weights: bool = True
    plugins: Sequence[PlannerPlugin] = field(default=())
    map_own_chunk: bool | Literal["auto"] = "auto"
    prefetch_depth: int = 1
    on_miss: Literal["gather", "raise"] = "gather"
    verify_replicas: bool = True

    def __post_init__(self) -> None:
        indices = layer_indices(self.sharded_layers)
        object.__setattr__(self, "sharded_layers", None if indices is None else tuple(indices))
        for name in ("lookahead", "trace", "keep_initial_weights", "verify_replicas"):
            require_bool(getattr(self, name), name)
        object.__setattr__(self, "plugins", tuple(check_plugins(self.plugins)))
        check_depth(self.prefetch_depth)
        if self.on_miss not in ON_MISS:
            raise ShardingError(f"on_miss must be 'gather' (such a layer is gathered now, warned) or 'raise', got "
                                f"{self.on_miss!r}")
        if not any(self.map_own_chunk is v or (isinstance(v, str) and self.map_own_chunk == v) for v in MAP_OWN_CHUNK):
            raise ShardingError(f"map_own_chunk must be True, False or 'auto', got {self.map_own_chunk!r}")
