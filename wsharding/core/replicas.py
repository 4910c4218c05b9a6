"""Are the replicas one model? A digest of every target's bytes, compared across the shard group.

Weight sharding assumes that every rank of a group holds the same bytes in each target: rank ``r``
keeps rows ``r`` of its own copy, and each gather assembles the weight from every rank's rows. Ranks
that built different weights (no seed set, a seed that depends on the rank) would assemble rows of
different models -- the *same* mixture on every rank, so no later check and no output can tell.
The layouts agree all the same (same shapes, same dtypes); only the values show it.

[Note: digest before the shrink]
The digest is taken in setup, of the full weight each rank holds, just before it keeps only its own
rows. It cannot be taken later: after the shrink no rank holds the rows its peers kept, so nothing
left is comparable; and after finalize's per-weight rebuild every rank holds the same weight -- the
gather's mixture of every rank's rows -- so digests taken there would agree even when the replicas
did not. It is also the cheap moment: setup reads the weight anyway to copy its rows, and the
weight is digested one at a time (a weight off the CPU reaches the host in blocks of 8 MiB: never a
copy of the model there). A target whose rows are loaded after setup (a checkpoint over weights kept as
built) drops its digest: the bytes it was taken of are gone.

The digest is SHA-256 of the weight's bytes in row-major order (and of their count), cut to 64
bits: a cryptographic hash, so no change of bytes that a user or a bug makes -- sign flips of any
number of elements, swapped rows or elements, bit flips anywhere -- leaves it equal except by a
2^-64 chance. A sum-like digest (each word times a weight of its position, modulo 2^64) is cheaper
on a GPU but linear, and structured differences cancel in it: two top-bit flips add 2^64. Every
device gives the same value: a weight off the CPU is copied to the host one block at a time. The
cost is the hash's speed on the host (about 0.6 s per GB where SHA-256 runs at 1.6 GB/s), once per
weight kept as built, at setup; nothing of it stays after the call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

#: Bytes hashed per step from a weight off the CPU: the host copy stays small on any device.
_BLOCK_BYTES = 8 << 20


def weight_digest(weight: torch.Tensor) -> int:
    """A 64-bit digest of ``weight``'s bytes (its values in row-major order), the same on every
    device; see the module docstring for why any change of bytes changes it."""
    data = weight.detach().contiguous().view(-1).view(torch.uint8)
    h = hashlib.sha256(data.numel().to_bytes(8, "little"))
    if data.device.type == "cpu":
        h.update(memoryview(data.numpy()))
    else:
        for at in range(0, data.numel(), _BLOCK_BYTES):
            h.update(memoryview(data[at:at + _BLOCK_BYTES].cpu().numpy()))
    return int.from_bytes(h.digest()[:8], "little")


def replica_difference(labels: Sequence[str], held: Sequence[Mapping[str, int]]) -> tuple[str, list[list[int]]] | None:
    """The first weight of ``labels`` whose digests differ between ranks (``held[r]``: rank ``r``'s
    digests, weights it has none of left out), and the ranks grouped by the value they hold; None
    when every weight agrees."""
    for label in labels:
        groups: dict[int, list[int]] = {}
        for rank, digests in enumerate(held):
            if label in digests:
                groups.setdefault(digests[label], []).append(rank)
        if len(groups) > 1:
            return label, list(groups.values())
    return None


def replicas_refusal(label: str, groups: list[list[int]]) -> str:
    """The message every rank raises when ``label`` differs between the ranks in ``groups``."""
    def ranks(g: list[int]) -> str:
        return f"rank {g[0]}" if len(g) == 1 else "ranks " + ", ".join(map(str, g))

    first, rest = groups[0], groups[1:]
    others = " and ".join(ranks(g) for g in rest)
    return (
        f"finalize refused on every rank: the ranks of this group built different weights -- {label} on {others} "
        f"differs from {label} on {ranks(first)} (the layouts agree; the bytes do not). Sharded, each rank would keep "
        "its rows of its own weights and every gather would assemble rows of different models, silently. Build the "
        "same weights on every rank: seed every rank the same before building the model (torch.manual_seed), or "
        "load one checkpoint on every rank (load_sharded); verify_replicas=False skips this check")
