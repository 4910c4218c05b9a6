"""Bound weights edited in place after finalize: found at the layer's next wait, and refused.

[Note: in-place edits of bound weights]
A sharded weight is a view of its slot, and every gather of its layer refills the slot from the
chunks: an in-place edit after finalize (``weight.mul_(2)``, an optimizer step) is silently undone
by the layer's next gather -- and, made while the slot holds another layer, lands in that layer's
bytes. It cannot be written back to the chunks in general (the bytes it reached may be another
layer's), so it is refused: outside its linear's forward at once, by the guard of [Note: reads of a
bound weight] in ``wsharding/core/bound.py``; inside a forward (where the weight is readable) by the
check here. The Parameter keeps its own version counter, which only in-place ops through it, its
views or its ``.data`` (for a bound weight a detached alias; torch's own ``.data`` has a fresh
counter) move -- a gather writes the slot buffer, never the Parameter -- so each
layer's wait compares its weights' versions with those at finalize: one C-level map over the
layer's few weights per layer and step. The first computation that would use (or lose) the edit
is the layer's next one, which always goes through that wait: the refusal comes before it, on
every rank that made the edit, and stays (the layer is refused from then on: its Parameters no
longer say what it computes with). ``WeightSharding.full_state_dict`` refuses it too.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch

from wsharding.core.errors import ShardingError

#: Read per layer and step, so a C-level getter rather than a lambda.
version_of = operator.attrgetter("_version")


class BoundVersions:
    """The version counters of every layer's bound weights at finalize, and what changed since.

    Read through detached aliases, which share the Parameter's version counter: a Parameter's own
    ``_version`` goes through its ``__torch_function__`` check, several times slower. An inference
    tensor has no version counter (and refuses in-place edits outside inference mode), so it is not
    tracked. The planner compares ``aliases[layer]`` with ``at_finalize[layer]`` inline at each wait.
    """

    def __init__(self, weights: Mapping[int, Sequence[tuple[str, torch.Tensor]]], rank: int) -> None:
        self.rank = rank
        tracked = {i: [(label, w) for label, w in ws if not w.is_inference()] for i, ws in weights.items()}
        self.aliases = {i: tuple(w.detach() for _, w in ws) for i, ws in tracked.items()}
        self.labels = {i: tuple(label for label, _ in ws) for i, ws in tracked.items()}
        self.at_finalize = {i: tuple(map(version_of, ws)) for i, ws in self.aliases.items()}

    def edited(self, layer: int | None = None) -> list[str]:
        """``"<label> on rank r was changed in place after finalize (version a -> b)"`` for every bound
        weight (of ``layer``, when given) edited in place since finalize."""
        return [f"{label} on rank {self.rank} was changed in place after finalize (version {v0} -> {w._version})"
                for i in (self.aliases if layer is None else [layer])
                for label, w, v0 in zip(self.labels[i], self.aliases[i], self.at_finalize[i], strict=True)
                if w._version != v0]

    def release(self) -> None:
        """Drop the aliases: they view the slots, and nothing may keep those alive after close."""
        self.aliases = dict.fromkeys(self.aliases, ())
        self.labels = dict.fromkeys(self.aliases, ())
        self.at_finalize = dict.fromkeys(self.aliases, ())


def refuse_edits(edited: list[str], what: str = "") -> None:
    """Raise the refusal of weights edited in place after finalize (``edited``: lines of
    :meth:`BoundVersions.edited`); nothing when the list is empty."""
    if edited:
        raise ShardingError(
            f"{what}{'; '.join(edited)}: a sharded weight is a view of a gather slot that every gather of its layer "
            "refills from the resident chunks, so the edit is silently undone, and it cannot be written back to the "
            "chunks. Change weights before finalize, or take WeightSharding.full_state_dict(model) on every rank of "
            "the shard group, change the copy, and load it into a freshly built model that you shard again. The "
            "layer is refused from now on")
