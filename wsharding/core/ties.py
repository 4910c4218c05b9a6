"""Tied weights: a sharding target whose storage something else also holds is refused.

Setup gives a target's Parameter this rank's rows, and finalize a view of a slot that other layers'
gathers overwrite; anything else holding the same storage (a head tied to a block's weight, the same
Linear in two blocks, a second tensor over the same memory) would then read stale rows or another
layer's weights. These functions index where every tensor of a module is held and find such holders.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

import torch
from torch import nn

from wsharding.core.errors import ShardingError
from wsharding.core.rowloaders import ShardTarget

#: Where a parameter or buffer is held: ``(path, module, attribute)``.
Place = tuple[str, nn.Module, str]


def tensor_places(root: nn.Module, skip: Container[int] = ()) -> list[Place]:
    """Every parameter and buffer attribute reachable from ``root``, at every path that reaches it (a
    module registered twice is listed twice), in registration order; modules whose ``id`` is in
    ``skip`` are not entered."""
    out: list[Place] = []
    stack: list[tuple[str, nn.Module, frozenset[int]]] = [("", root, frozenset())]
    while stack:
        path, mod, above = stack.pop()
        if id(mod) in skip or id(mod) in above:
            continue
        out += [(f"{path}.{attr}" if path else attr, mod, attr) for attr in [*mod._parameters, *mod._buffers]]
        inner = above | {id(mod)}
        stack += [(f"{path}.{name}" if path else name, child, inner)
                  for name, child in reversed(mod._modules.items()) if child is not None]
    return out


def storage_key(t: torch.Tensor | None) -> tuple | None:
    """What two tensors that share memory have in common: their storage (a tied weight, or any view
    of it); a meta tensor has no memory, so only the tensor object itself. None: nothing to share."""
    if t is None:
        return None
    if t.is_meta:
        return ("meta", id(t))
    st = t.untyped_storage()
    return (t.device, st.data_ptr()) if st.nbytes() else None


def held_by(place: Place) -> torch.Tensor | None:
    """The tensor a place holds now (setup and finalize give targets new storage)."""
    _, mod, attr = place
    return mod._parameters[attr] if attr in mod._parameters else mod._buffers.get(attr)


def by_storage(places: Iterable[Place]) -> dict[tuple, list[Place]]:
    """``places`` grouped by the storage they hold now (:func:`storage_key`)."""
    out: dict[tuple, list[Place]] = {}
    for place in places:
        key = storage_key(held_by(place))
        if key is not None:
            out.setdefault(key, []).append(place)
    return out


def refuse_ties(targets: Sequence[ShardTarget], held: Mapping[tuple, list[Place]], where: str, rank: int, *,
                own_layer: bool = False, recheck: bool = False, of: str = "") -> None:
    """Raise when a place of ``held`` (places by storage) holds a target's storage. ``own_layer``:
    the places are the targets' own layer, where the target's own attribute (its module's
    ``weight``) is not a tie. ``recheck``: ``held`` was indexed earlier, so a place counts only if
    it still holds that storage (memory freed since may have been reused).

    Why refused, even inside the block: setup gives the target's Parameter this rank's rows and
    finalize a view of a slot that other layers' gathers overwrite. Every other holder would read
    another layer's weights when it runs outside the layer (a head tied to a block's weight), keep
    the full replicated memory and miss what loading writes (a separate tensor over the same
    storage), or be loaded and processed as a replicated weight (a package linear that is not a
    target runs its after-loading step on the row shard)."""
    for t in targets:
        key = storage_key(t.module.weight)
        for place in held.get(key, ()) if key is not None else ():
            if own_layer and place[1] is t.module and place[2] == "weight":
                continue
            if recheck and storage_key(held_by(place)) != key:
                continue
            holder = f"{where}{place[0]}"
            raise ShardingError(
                f"{t.label} on rank {rank} is a sharding target, and its storage is also {holder}{of} "
                "(a tied weight): sharded, that memory is replaced by this rank's rows and then by a view of a "
                "slot that other layers' gathers overwrite, so that holder would read stale rows or another "
                f"layer's weights. Untie them (give {holder} a tensor of its own), or leave {t.name} out of the "
                "targets")
