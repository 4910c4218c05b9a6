"""CUDA's virtual memory calls, bound with ctypes: one address range made of several allocations.

A layer's gathered view is one contiguous address range whose slices lie in different physical
allocations: this rank's slice is the layer's resident chunk, the others are a slot's pages
([Note: the own chunk mapped, not copied] in ``wsharding/accel/mapped_slots.py``). The driver's virtual
memory API builds exactly that: reserve an address range, map allocations into it side by side,
grant the device access. An allocation is named by its handle; ``cuMemRetainAllocationHandle`` gives
the handle of memory another allocator made (``ncclMemAlloc``), so the same pages can appear at two
addresses -- where their owner put them and inside a view.

``cuMemMap`` maps an allocation from its start (the offset must be 0), a size that is whole pages of
the allocation granularity. Like ``cuda_driver``, the library is the process's ``libcuda.so.1``,
opened on first use.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_size_t, c_uint64, c_void_p

from wsharding.accel.cuda_driver import DriverFn, bind_functions, check_cu

CUdeviceptr = c_uint64
CUmemHandle = c_uint64  # CUmemGenericAllocationHandle


class MemLocation(ctypes.Structure):
    """CUmemLocation: ``type`` 1 is a device, ``id`` its ordinal."""

    _fields_ = [("type", c_int), ("id", c_int)]


class AllocationFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):
    """CUmemAllocationProp (32 bytes on x86-64): pinned device memory, here only to ask the granularity."""

    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", MemLocation),
                ("win32HandleMetaData", c_void_p), ("allocFlags", AllocationFlags)]


class AccessDesc(ctypes.Structure):
    """CUmemAccessDesc: ``flags`` 3 is read and write."""

    _fields_ = [("location", MemLocation), ("flags", c_int)]


MEM_LOCATION_DEVICE = 1
MEM_ALLOCATION_PINNED = 1
MEM_HANDLE_POSIX_FD = 1
MEM_ACCESS_READWRITE = 3
GRANULARITY_MINIMUM = 0


#: The virtual-memory functions, rows of the same table shape as the hot path's (``cuda_driver``).
FUNCTIONS: tuple[DriverFn, ...] = (
    DriverFn("cuMemGetAllocationGranularity", (POINTER(c_size_t), POINTER(AllocationProp), c_int),
          "the page size that every mapping is a multiple of"),
    DriverFn("cuMemAddressReserve", (POINTER(CUdeviceptr), c_size_t, c_size_t, CUdeviceptr, c_uint64),
          "reserve a layer view's address range (no memory yet)"),
    DriverFn("cuMemAddressFree", (CUdeviceptr, c_size_t), "give the range back"),
    DriverFn("cuMemMap", (CUdeviceptr, c_size_t, c_size_t, CUmemHandle, c_uint64),
          "place an allocation's pages at an address of the range"),
    DriverFn("cuMemUnmap", (CUdeviceptr, c_size_t), "take them out again"),
    DriverFn("cuMemSetAccess", (CUdeviceptr, c_size_t, POINTER(AccessDesc), c_size_t),
          "let the device read and write the mapped range"),
    DriverFn("cuMemRetainAllocationHandle", (POINTER(CUmemHandle), c_void_p),
          "the handle of the allocation behind an address (ncclMemAlloc's memory)"),
    DriverFn("cuMemRelease", (CUmemHandle,), "drop a retained handle (the pages live while mapped)"),
)


class VirtualMemory:
    """The calls of :data:`FUNCTIONS` for one device, each raising :class:`CudaDriverError`."""

    def __init__(self, device_index: int, path: str = "libcuda.so.1") -> None:
        bind_functions(self, FUNCTIONS, path)
        self.device_index = device_index
        where = MemLocation(MEM_LOCATION_DEVICE, device_index)
        self._access = AccessDesc(where, MEM_ACCESS_READWRITE)
        self._prop = AllocationProp(MEM_ALLOCATION_PINNED, MEM_HANDLE_POSIX_FD, where, None, AllocationFlags())

    def granularity(self) -> int:
        g = c_size_t(0)
        check_cu(self._cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(self._prop), GRANULARITY_MINIMUM),
                 "cuMemGetAllocationGranularity")
        return g.value

    def reserve(self, nbytes: int) -> int:
        ptr = CUdeviceptr(0)
        check_cu(self._cuMemAddressReserve(ctypes.byref(ptr), nbytes, 0, 0, 0), f"cuMemAddressReserve({nbytes})")
        return ptr.value

    def free_range(self, ptr: int, nbytes: int) -> None:
        check_cu(self._cuMemAddressFree(ptr, nbytes), "cuMemAddressFree")

    def retain(self, ptr: int) -> int:
        h = CUmemHandle(0)
        check_cu(self._cuMemRetainAllocationHandle(ctypes.byref(h), ptr), f"cuMemRetainAllocationHandle({ptr:#x})")
        return h.value

    def release(self, handle: int) -> None:
        check_cu(self._cuMemRelease(handle), "cuMemRelease")

    def map(self, ptr: int, nbytes: int, handle: int) -> None:
        """Map ``nbytes`` from the start of allocation ``handle`` at ``ptr``, readable and writable."""
        check_cu(self._cuMemMap(ptr, nbytes, 0, handle, 0), f"cuMemMap({ptr:#x}, {nbytes})")
        check_cu(self._cuMemSetAccess(ptr, nbytes, ctypes.byref(self._access), 1), "cuMemSetAccess")

    def unmap(self, ptr: int, nbytes: int) -> None:
        check_cu(self._cuMemUnmap(ptr, nbytes), "cuMemUnmap")
