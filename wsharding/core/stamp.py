"""A gather outside the steps, each rank's chunk sent with a stamp of its layer and step.

[Note: the stamp of a gather outside the steps]
The channel for gathers outside the steps pairs whatever its ranks send: rank 0 calling block 0 on
its own while rank 1 calls block 1 would give each a layer made of both layers' chunks. So each rank
sends its chunk with a 16-byte stamp after it (a magic number, the layer, the step) and every rank
compares all stamps it received before a byte is written into the slot: different ones raise
:class:`MismatchedGatherError` on every rank of the gather, the slot left as it was. The stamp
travels in a host buffer the gather is staged in (both backends take this rare, warned path through
host memory anyway; the buffer lives only for the call), so no layout, resident byte or formula
changes, and the steps' own gathers pay nothing.
"""

from __future__ import annotations

import torch

from wsharding.core.comm import Communicator
from wsharding.core.errors import ShardingError


class MismatchedGatherError(ShardingError):
    """A gather combined chunks of different layers or steps ([Note: the stamp of a gather outside the
    steps]): refused on every rank of the gather, nothing written into its slot."""


#: The stamp's bytes: a magic number, the layer (int32) and the step (int64), in the host's byte order.
STAMP_BYTES = 16
_STAMP_MAGIC = 0x5753_4844  # "WSHD"


def stamp_of(layer: int, step: int) -> torch.Tensor:
    """The 16-byte stamp of ``layer``'s gather in ``step`` (a uint8 tensor on the host)."""
    t = torch.empty(STAMP_BYTES, dtype=torch.uint8)
    t[:8].view(torch.int32).copy_(torch.tensor([_STAMP_MAGIC, layer], dtype=torch.int32))
    t[8:].view(torch.int64).fill_(step)
    return t


def read_stamp(raw: torch.Tensor) -> tuple[int, int] | None:
    """``(layer, step)`` of a stamp's 16 bytes; None when they are not a stamp (no magic number)."""
    raw = raw.contiguous()
    magic, layer = raw[:8].view(torch.int32).tolist()
    if magic != _STAMP_MAGIC:
        return None
    return layer, int(raw[8:].view(torch.int64).item())


def gather_stamped(comm: Communicator, full: torch.Tensor, chunk: torch.Tensor, layer: int, step: int,
                   what: str) -> None:
    """Gather ``layer``'s chunks into ``full`` on the channel outside the steps, each rank's chunk sent
    with its stamp; :class:`MismatchedGatherError` on every rank when the stamps differ, ``full``
    untouched."""
    n = comm.world_size
    if n == 1:  # no peer to pair with
        comm.gather_outside_steps(full, chunk, what=what)
        return
    c = chunk.numel()
    # Staged in host memory: both backends' channel for these gathers goes through it anyway.
    send = torch.empty(c + STAMP_BYTES, dtype=torch.uint8)
    send[:c].copy_(chunk)
    send[c:].copy_(stamp_of(layer, step))
    recv = torch.empty(n * (c + STAMP_BYTES), dtype=torch.uint8)
    comm.gather_outside_steps(recv, send, what=what)
    rows = recv.view(n, c + STAMP_BYTES)
    sent = [read_stamp(rows[r, c:]) for r in range(n)]
    if any(got != (layer, step) for got in sent):
        told = ", ".join(f"rank {r} sent " + ("no stamp" if got is None else f"layer {got[0]} of step {got[1]}")
                         for r, got in enumerate(sent))
        raise MismatchedGatherError(
            f"layer {layer} on rank {comm.rank}: its gather outside the steps was paired with other gathers: "
            f"{told}. Nothing was written into its slot. A block (or linear) called outside the "
            "model's forward gathers its layer on its own: every rank of the shard group must make the same "
            "call, the same layer after the same steps")
    full.view(n, c).copy_(rows[:, :c])
