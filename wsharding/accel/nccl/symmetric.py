"""Symmetric buffers: ncclMemAlloc memory, seen by torch without copies, registered as windows.

Why these rules (NCCL's documentation of symmetric windows): NCCL's copy-engine AllGather only runs when
send and receive buffers lie inside windows registered with ``NCCL_WIN_COLL_SYMMETRIC``; such windows
need memory from ``ncclMemAlloc`` (cudaMalloc memory is refused) at a 4096-byte aligned offset, and
registering is a collective that every rank must call in the same order.

How this module meets them:

* :meth:`SymmetricPool.alloc` makes one ``ncclMemAlloc`` per buffer (offset 0 inside its
  allocation, so always aligned) and returns a uint8 torch tensor over that memory through
  ``__cuda_array_interface__`` -- no copy, same ``data_ptr``;
* allocation is local and may happen in any order (loaders, slots, lazily built layers);
  :meth:`SymmetricPool.register_all` then registers every new buffer in one fixed order, sorted
  by tag with numbers compared as numbers ("layer.2" < "layer.10", like the weight-sharding design's sort by
  layer id), after checking over the CPU group that every rank has the same list of tags and
  sizes. Deferring registration to one call is what makes the order independent of how the
  buffers were created, and turns a mismatch (which would hang or corrupt) into an error.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from wsharding.accel.nccl.binding import NCCL_WIN_COLL_SYMMETRIC
from wsharding.core.comm import CommError
from wsharding.core.units import align_up

#: Offsets and sizes inside windows are multiples of this (NCCL's symmetric-window rule).
WINDOW_ALIGN = 4096


def tag_sort_key(tag: str) -> tuple:
    """Natural order: digit runs compare as integers, so layer 2 registers before layer 10."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", tag) if p)


class DeviceMemory:
    """A 1-D uint8 view of raw device memory that ``torch.as_tensor`` wraps without copying.

    torch keeps a reference to this object for as long as the tensor lives; the memory itself is
    owned by the :class:`SymmetricPool` that made it.
    """

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        # stream None: the memory is fresh, torch need not synchronise with any stream.
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": None}


def wrap_device_memory(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``ptr`` on ``device``; raises if torch copied."""
    t = torch.as_tensor(DeviceMemory(ptr, nbytes), device=device)
    if t.data_ptr() != ptr or t.numel() != nbytes or t.dtype != torch.uint8:
        raise CommError(f"torch copied the ncclMemAlloc buffer (ptr {ptr:#x} -> {t.data_ptr():#x}); expected a view")
    return t


@dataclass
class SymmetricBuffer:
    """One ncclMemAlloc allocation and, once registered, its window."""

    tag: str
    seq: int
    nbytes: int
    alloc_bytes: int
    ptr: int
    tensor: torch.Tensor
    window: int | None = None
    freed: bool = False
    #: False: memory that is only ever reached through a window over another address range (a page
    #: mapped into a layer's view): it gets no window of its own.
    wants_window: bool = True
    #: For an address range built elsewhere (:meth:`SymmetricPool.adopt`): what frees it, instead of
    #: ``ncclMemFree``; such a range owns no memory of its own.
    release_memory: Callable[[], None] | None = None

    @property
    def shared(self) -> bool:
        """A symmetric window (or one to be): the peers map it, so only a collective may free it."""
        return self.wants_window or self.window is not None

    def contains(self, t: torch.Tensor) -> bool:
        start = t.data_ptr()
        return self.ptr <= start and start + t.numel() * t.element_size() <= self.ptr + self.alloc_bytes


def check_same_registration(per_rank: list[list[tuple[str, int]]]) -> None:
    """Every rank must register the same (tag, bytes) list in the same order, or NCCL hangs or
    pairs the wrong buffers. Raises naming the first rank and position that differ."""
    first = per_rank[0]
    for rank, mine in enumerate(per_rank[1:], start=1):
        if mine == first:
            continue
        for i in range(max(len(first), len(mine))):
            a = first[i] if i < len(first) else None
            b = mine[i] if i < len(mine) else None
            if a != b:
                raise CommError(
                    f"window registration differs between ranks at position {i}: rank 0 has {a}, rank {rank} "
                    f"has {b} (tag, bytes). Every rank must alloc() the same tags with the same sizes "
                    "before register_all()"
                )


class WindowOwner(Protocol):
    """What a pool needs of the communicator that owns it (the communicator module builds on this
    one, not the other way round): the binding, the comm handle, the device, an exchange over the
    CPU group and the result checker that polls a non-blocking communicator."""

    nccl: Any
    handle: int | None
    device: torch.device

    def exchange(self, obj: Any) -> list[Any]: ...

    def complete(self, rc: int, what: str) -> None: ...


@dataclass
class SymmetricPool:
    """The buffers of one communicator (a :class:`WindowOwner`)."""

    comm: WindowOwner
    buffers: list[SymmetricBuffer] = field(default_factory=list)
    #: Tags in the order their windows were registered (the same on every rank).
    registered_order: list[str] = field(default_factory=list)

    def alloc(self, nbytes: int, tag: str, *, window: bool = True) -> torch.Tensor:
        """Allocate ``nbytes`` of ncclMemAlloc memory (local, not collective); returns the tensor.
        ``window=False``: never registered (memory reached only through another buffer's window)."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise CommError(f"alloc({nbytes!r}, tag={tag!r}): nbytes must be a positive integer")
        if any(b.tag == tag and not b.freed for b in self.buffers):
            raise CommError(f"alloc: tag {tag!r} is already used; tags name windows and must be unique")
        c = self.comm
        size = align_up(nbytes, WINDOW_ALIGN)
        ptr = ctypes.c_void_p()
        with torch.cuda.device(c.device):
            c.nccl.check(c.nccl.ncclMemAlloc(ctypes.byref(ptr), size), f"ncclMemAlloc({size}) for {tag!r}")
        if ptr.value % WINDOW_ALIGN:
            raise CommError(f"ncclMemAlloc returned {ptr.value:#x}, not {WINDOW_ALIGN}-aligned")
        tensor = wrap_device_memory(ptr.value, size, c.device)[:nbytes]
        self.buffers.append(SymmetricBuffer(tag, len(self.buffers), nbytes, size, ptr.value, tensor,
                                            wants_window=window))
        return tensor

    def adopt(self, tensor: torch.Tensor, tag: str, release_memory: Callable[[], None]) -> None:
        """Take an address range built elsewhere (a layer's view mapped over other allocations) as a
        buffer: it is registered with the others (collective, by tag) and ``release_memory`` undoes
        it when the buffer is released or the pool freed."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes % WINDOW_ALIGN or tensor.data_ptr() % WINDOW_ALIGN:
            raise CommError(f"adopt({tag!r}): {nbytes} bytes at {tensor.data_ptr():#x} are not whole {WINDOW_ALIGN}-byte "
                            "units of the window rule")
        if any(b.tag == tag and not b.freed for b in self.buffers):
            raise CommError(f"adopt: tag {tag!r} is already used; tags name windows and must be unique")
        self.buffers.append(SymmetricBuffer(tag, len(self.buffers), nbytes, nbytes, tensor.data_ptr(), tensor,
                                            release_memory=release_memory))

    def _free(self, b: SymmetricBuffer) -> str | None:
        """Free one buffer's memory (or undo an adopted range); an error text, or None."""
        b.freed = True
        if b.release_memory is not None:
            b.release_memory()
            return None
        rc = self.comm.nccl.ncclMemFree(b.ptr)
        return None if rc == 0 else f"{b.tag}: {self.comm.nccl.error_string(rc)}"

    def pending(self) -> list[SymmetricBuffer]:
        """Buffers not registered yet, in registration order."""
        todo = [b for b in self.buffers if b.window is None and not b.freed and b.wants_window]
        return sorted(todo, key=lambda b: (tag_sort_key(b.tag), b.seq))

    def register_all(self) -> int:
        """Collective: register every pending buffer as a symmetric window, sorted by tag.
        Returns the number of windows registered."""
        c = self.comm
        todo = self.pending()
        lists = c.exchange([(b.tag, b.alloc_bytes) for b in todo])
        check_same_registration(lists)
        for b in todo:
            win = ctypes.c_void_p()
            rc = c.nccl.ncclCommWindowRegister(c.handle, b.ptr, b.alloc_bytes, ctypes.byref(win), NCCL_WIN_COLL_SYMMETRIC)
            c.complete(rc, f"ncclCommWindowRegister({b.tag!r}, {b.alloc_bytes} bytes)")
            b.window = win.value
            self.registered_order.append(b.tag)
        return len(todo)

    def window_of(self, t: torch.Tensor) -> SymmetricBuffer | None:
        for b in self.buffers:
            if not b.freed and b.contains(t):
                return b
        return None

    def deregister_all(self) -> None:
        """Collective: deregister in the reverse of the registration order."""
        c = self.comm
        registered = [b for b in self.buffers if b.window is not None and not b.freed]
        for b in sorted(registered, key=lambda b: (tag_sort_key(b.tag), b.seq), reverse=True):
            rc = c.nccl.ncclCommWindowDeregister(c.handle, b.window)
            b.window = None
            c.complete(rc, f"ncclCommWindowDeregister({b.tag!r})")

    def release(self, tensors: list[torch.Tensor]) -> None:
        """Collective: deregister the windows of the buffers behind ``tensors`` (the same tags on
        every rank, checked) and free their memory; the pool's other buffers stay."""
        c = self.comm
        mine = [b for b in self.buffers if not b.freed and any(b.contains(t) for t in tensors)]
        # Pages that never get a window of their own are this rank's business: which of them a rank
        # still holds may differ (a trimmed mapped pool keeps only the peers' pages), so they are left
        # out of the check, and freed last -- after the windows over the ranges that map them.
        shared = [b for b in mine if b.shared]
        local = [b for b in mine if not b.shared]
        check_same_registration(c.exchange([(b.tag, b.alloc_bytes) for b in shared]))
        torch.cuda.synchronize(c.device)  # no copy may still touch the memory we free
        for b in sorted(shared, key=lambda b: (tag_sort_key(b.tag), b.seq), reverse=True) + local:
            if b.window is not None:
                rc = c.nccl.ncclCommWindowDeregister(c.handle, b.window)
                b.window = None
                c.complete(rc, f"ncclCommWindowDeregister({b.tag!r})")
            error = self._free(b)
            if error is not None:
                raise CommError(f"ncclMemFree failed for {error}")

    def free_unshared(self, tensors: list[torch.Tensor]) -> None:
        """Free the buffers behind ``tensors`` that no peer maps: allocated with ``window=False`` and
        reached by no window any more. Local, not collective (each rank frees its own)."""
        mine = [b for b in self.buffers if not b.freed and any(b.contains(t) for t in tensors)]
        shared = [b.tag for b in mine if b.shared]
        if shared:
            raise CommError(f"free_unshared: {shared} are (or will be) symmetric windows that the peers map; "
                            "release them together (release(), collective)")
        torch.cuda.synchronize(self.comm.device)  # no copy may still touch the memory we free
        errors = [e for e in (self._free(b) for b in mine) if e is not None]
        if errors:
            raise CommError("ncclMemFree failed for " + "; ".join(errors))

    def free_all(self) -> None:
        """Free every allocation (after deregistration, or after the communicator was aborted)."""
        errors = []
        # adopted ranges first: they map the pages the others free
        for b in sorted(self.buffers, key=lambda b: b.release_memory is None):
            if b.freed:
                continue
            b.window = None
            error = self._free(b)
            if error is not None:
                errors.append(error)
        if errors:
            raise CommError("ncclMemFree failed for " + "; ".join(errors))

    @property
    def allocated_bytes(self) -> int:
        """Device memory this pool holds (``ncclMemAlloc``; adopted ranges own none)."""
        return sum(b.alloc_bytes for b in self.buffers if not b.freed and b.release_memory is None)

    @property
    def registered_bytes(self) -> int:
        return sum(b.alloc_bytes for b in self.buffers if b.window is not None and not b.freed)
