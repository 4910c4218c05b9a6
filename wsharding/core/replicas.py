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
weight is digested where it lies (one weight at a time, in blocks, on its own device: no copy of the
model to the host). A target whose rows are loaded after setup (a checkpoint over weights kept as
built) drops its digest: the bytes it was taken of are gone.

The digest is exact integer arithmetic on the weight's bytes, read as 64-bit words: the sum, modulo
2^64, of each word times a fixed odd pseudo-random weight of its position. Sums modulo 2^64 do not
depend on the order of the additions, so every device and every reduction order gives the same
value, and a single changed word always changes it (an odd factor is invertible modulo 2^64).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

_MASK = (1 << 64) - 1
#: Words digested per step: 8 MiB of weight, so the temporaries stay small on any device.
_BLOCK_WORDS = 1 << 20
#: The position factors of one block, per device (made once on the CPU, copied).
_FACTORS: dict[torch.device, torch.Tensor] = {}


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a fixed pseudo-random 64-bit value for ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    """``x`` modulo 2^64 as a signed int64 (what a torch int64 scalar takes)."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def _factors(device: torch.device) -> torch.Tensor:
    """One odd pseudo-random int64 per position of a block: splitmix64's steps on the position, in
    torch's wrapping int64 arithmetic (arithmetic shifts: still a fixed sequence)."""
    if device not in _FACTORS:
        if "cpu" not in {d.type for d in _FACTORS}:
            x = torch.arange(_BLOCK_WORDS, dtype=torch.int64) * _signed(0x9E3779B97F4A7C15) + 1
            x = (x ^ (x >> 30)) * _signed(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> 27)) * _signed(0x94D049BB133111EB)
            _FACTORS[torch.device("cpu")] = (x ^ (x >> 31)) | 1
        _FACTORS[device] = _FACTORS[torch.device("cpu")].to(device)
    return _FACTORS[device]


def weight_digest(weight: torch.Tensor) -> int:
    """A 64-bit digest of ``weight``'s bytes (its values in row-major order), the same on every
    device; see the module docstring for why it is exact and order-free."""
    data = weight.detach().contiguous().view(-1).view(torch.uint8)
    if data.storage_offset() % 8:
        data = data.clone()  # a view at an odd byte offset cannot be read as int64 words
    n = data.numel()
    whole = n - n % 8
    words = data[:whole].view(torch.int64)
    factors = _factors(data.device)
    acc = torch.zeros((), dtype=torch.int64, device=data.device)
    blocks = (words.numel() + _BLOCK_WORDS - 1) // _BLOCK_WORDS
    for b in range(blocks):
        part = words[b * _BLOCK_WORDS : (b + 1) * _BLOCK_WORDS]
        acc += (part * factors[: part.numel()]).sum() * _signed(_mix64(b) | 1)
    value = int(acc.item()) & _MASK
    if n > whole:  # the last bytes, zero-padded to one word
        tail = int.from_bytes(bytes(data[whole:].cpu().tolist()), "little")
        value += tail * (_mix64(blocks) | 1)
    return _mix64((value ^ n) & _MASK)


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
