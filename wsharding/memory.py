"""Load peaks, measured: device bytes (CUDA allocator) and host bytes (resident-set high-water mark).

SGLang's weight sharding for Kimi K3 separates the resident bytes after finalize from the *peak* while
loading: a loader that reads full weights into device memory and cuts them afterwards has the peak of
the replicated model, and may run out of memory at start-up even though the resident bytes would fit.

:class:`PeakMeter` brackets a stretch of work (checkpoint load + finalize):

* device peak: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, counted above
  what was allocated at the start, plus ``held_bytes`` (the sharded weights that already existed
  at the start -- the row shards -- so the number is the peak of the sharded weights themselves),
  plus bytes a backend allocated outside torch's allocator (``ncclMemAlloc``) -- see [Note: two
  allocators] for how the two are added;
* host peak: the resident-set high-water mark (``getrusage`` ``ru_maxrss``) after resetting it
  (Linux: ``/proc/self/clear_refs``), counted above the resident set at the start. When the mark
  cannot be reset, the number is the process's lifetime peak and ``host_exact`` is False.

On CPU ranks the device *is* host memory: both numbers are the resident set, ``held_bytes`` included
(emulated ranks say so in every report). The resident set follows what is allocated only if freed
memory goes back to the system: glibc keeps freed blocks below its (dynamic) mmap threshold in its
heap, where they stay resident, and hands them out again without the resident set moving. So on
CPU ranks :func:`map_large_allocations` first makes every allocation of 64 KiB or more a mapping of
its own, unmapped when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# [Note: two allocators]
# With our NCCL communicator the chunks and slots come from ncclMemAlloc, which torch's peak does not
# see. Adding the outside bytes at the end to torch's peak over the whole stretch counts twice what
# finalize swaps: the row shards (torch, freed layer by layer) and the chunks that replace them
# (outside, allocated layer by layer) -- on two H200s the demo's k3-like finalize read 4595 MiB that
# way against a bound of 2777 MiB. So the stretch is cut into intervals at the points where the
# outside allocations happen (``sample()``, called by finalize's ``observe`` after each layer's
# stages): per interval, torch's peak in it plus the outside bytes at its end (the larger of its
# start and end, should any be freed), and the meter keeps the largest. Exact when the outside
# allocations happen at interval ends, as finalize's do; without samples it is the old upper bound.


def rss_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``; else the high-water mark)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The resident-set high-water mark (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current resident set (Linux >= 4.0); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def map_large_allocations(threshold: int = 64 << 10) -> bool:
    """glibc only: serve every allocation of ``threshold`` bytes or more with its own mapping (and
    return it to the system when freed), so that the resident set tracks live allocations. Setting
    the threshold also stops glibc from raising it on its own. False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)) == 1
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, int(threshold)) == 1
        libc.malloc_trim(0)  # give back what is already free, so it cannot leave during the measurement
        return ok
    except (OSError, AttributeError):
        return False


def trim_host_heap() -> int:
    """glibc only: give the heap's free memory back to the system (``malloc_trim(0)``) and return the
    bytes the resident set shrank by; 0 where there is no glibc.

    Why after loading: the row shards, the checkpoint's read buffers and the build's temporaries are
    freed by then, but glibc keeps freed blocks below its mmap threshold in its heap, resident, until
    something trims it -- a rank's resident set would stay hundreds of MiB above the bytes it holds."""
    name = ctypes.util.find_library("c")
    if not name:
        return 0
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return 0
    before = rss_bytes()
    trim(0)
    return max(0, before - rss_bytes())


@dataclass
class LoadPeak:
    """What a :class:`PeakMeter` measured (bytes)."""

    device: str
    device_peak_bytes: int
    host_peak_bytes: int
    held_bytes: int
    host_exact: bool
    #: True on CPU ranks: device and host are the same memory (both numbers are the resident set).
    device_is_host: bool
    #: True when large host allocations were mapped one by one (:func:`map_large_allocations`).
    host_mapped: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PeakMeter:
    """``with PeakMeter(device, held_bytes=...) as m: ...`` then ``m.result`` (a :class:`LoadPeak`)."""

    def __init__(self, device: torch.device | str, *, held_bytes: int = 0,
                 outside_allocator: Callable[[], int] | None = None, map_host: bool = True) -> None:
        self.device = torch.device(device)
        self.held = int(held_bytes)
        self.outside = outside_allocator
        #: On CPU ranks, map every large allocation on its own before measuring; False measures the
        #: allocator as the work itself leaves it (what a caller who never set it gets).
        self.map_host = map_host
        self.result: LoadPeak | None = None

    def __enter__(self) -> PeakMeter:
        self._mapped = map_large_allocations() if self.device.type == "cpu" and self.map_host else False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._dev0 = torch.cuda.memory_allocated(self.device)
            self._out0 = self._out_prev = self.outside() if self.outside else 0
            self._dev_peak = self.held
        self._host_exact = reset_peak_rss()
        self._rss0 = rss_bytes()
        return self

    def sample(self) -> int:
        """End one interval of the device peak and start the next ([Note: two allocators]); returns
        the device peak so far (CUDA), or the host peak so far (CPU ranks)."""
        if self.device.type != "cuda":
            return max(0, peak_rss_bytes() - self._rss0) + self.held
        out = self.outside() if self.outside else 0
        interval = (torch.cuda.max_memory_allocated(self.device) - self._dev0 + self.held
                    + max(out, self._out_prev) - self._out0)
        self._dev_peak = max(self._dev_peak, interval)
        self._out_prev = out
        torch.cuda.reset_peak_memory_stats(self.device)
        return self._dev_peak

    def __exit__(self, *exc: object) -> None:
        host = max(0, peak_rss_bytes() - self._rss0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            dev = self.sample()
            is_host = False
        else:
            host += self.held
            dev, is_host = host, True
        self.result = LoadPeak(str(self.device), int(dev), int(host), self.held, self._host_exact, is_host,
                               self._mapped)
