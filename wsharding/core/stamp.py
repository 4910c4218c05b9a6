"""What tells a gather paired with a different one: the stamp of a gather outside the steps, and the
sampled bytes of every chunk that a steps' gather is checked against when it lands.

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

import ctypes

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


class LandedSamples:
    """Every rank's chunk of every layer, sampled at finalize: eight known bytes per rank and layer,
    compared after each of the steps' gathers lands.

    [Note: the sample of a steps' gather]
    The steps' gathers pair by order ([Note: one collective sequence per step] in
    :mod:`wsharding.core.step_owner`), and their chunks carry no stamp: a weight spans chunk
    boundaries, so bytes inserted per chunk would break the layer's zero-copy views. Ranks whose
    steps issue different sequences -- a step over blocks ``[0, L)`` on one rank and ``[1, L)`` on
    another -- would pair layer 0 with layer 1, and every rank would compute with a layer made of
    both: wrong outputs, no error. So once, at finalize, every rank takes from each of its chunks
    the first eight bytes that are not zero (their offset and value), and the ranks exchange them
    (one small gather, before the first step). After each of the steps' gathers lands, the rank reads
    those eight bytes of every rank's part of the slot in place -- one read and one compare per
    rank, the same cost for any layer size -- and a part that holds other bytes is another gather's:
    :class:`MismatchedGatherError` on every rank that received it, nothing computed from the slot,
    the step given up. A gather of the same layer in another step carries the same bytes and is
    not told apart: it is harmless. Reading the slot on a GPU would wait for the GPU, so CUDA ranks
    make no such check.
    """

    def __init__(self, comm: Communicator, chunks: dict[int, torch.Tensor], fulls: dict[int, torch.Tensor]) -> None:
        self.rank = comm.rank
        layers = sorted(chunks)
        mine = torch.zeros(len(layers), 2, dtype=torch.int64)
        for k, layer in enumerate(layers):
            words = chunks[layer].view(torch.int64)
            nonzero = torch.nonzero(words)
            at = int(nonzero[0, 0]) if len(nonzero) else 0
            mine[k, 0], mine[k, 1] = at, words[at]
        n = comm.world_size
        got = torch.empty(n * mine.numel(), dtype=torch.int64)
        comm.all_gather_into(got.view(torch.uint8), mine.view(torch.uint8).view(-1),
                             what="finalize: the samples of every rank's chunks")
        got = got.view(n, len(layers), 2)
        #: Per layer: each rank's sampled word, read in place in the slot (host memory: CPU ranks only),
        #: and the value it must hold.
        self.cells: dict[int, list[ctypes.c_int64]] = {}
        self.expect: dict[int, list[int]] = {}
        for k, layer in enumerate(layers):
            base, words = fulls[layer].data_ptr(), chunks[layer].numel() // 8
            self.cells[layer] = [ctypes.c_int64.from_address(base + 8 * (r * words + int(got[r, k, 0])))
                                 for r in range(n)]
            self.expect[layer] = [int(v) for v in got[:, k, 1]]

    def check(self, layer: int, step: int) -> None:
        """Raise :class:`MismatchedGatherError` when ``layer``'s slot holds another gather's bytes."""
        expect = self.expect[layer]
        others = [r for r, cell in enumerate(self.cells[layer]) if cell.value != expect[r]]
        if not others:
            return
        raise MismatchedGatherError(
            f"layer {layer} on rank {self.rank}: its gather of step {step} was paired with another gather on "
            f"rank(s) {others}: the bytes they sent are not their part of layer {layer} "
            "([Note: the sample of a steps' gather]). Nothing computed with them. The ranks of the shard group "
            "issued different gathers: every rank must run the same steps over the same blocks (the same start "
            "and end, the same schedule and plug-ins). The group is out of step: close this sharding and shard "
            "the model again")
