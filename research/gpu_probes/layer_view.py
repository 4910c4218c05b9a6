"""Can a layer's gathered view be built without copying the rank's own chunk? A mapping probe.

    torchrun --nproc-per-node N research/gpu_probes/layer_view.py     # N ranks; prints JSON on rank 0

Why: every gather today copies the rank's own chunk into its slot first (a same-device copy, on the
SMs, ~100 us per 218 MB layer on an H200; [Note: no serial local copy] in wsharding/accel/nccl/
gather.py). With CUDA's virtual memory API the copy need not exist at all: reserve one address range
per layer of the layer's full size S, map the rank's slice of it onto the physical pages of that
layer's *resident chunk*, and the other N-1 slices onto the physical pages of a slot. An in-place
AllGather into that range then moves only the peers' bytes; the own chunk is already in place, and a
slot needs only (N-1)/N * S of memory instead of S.

What must hold for that, checked here on whatever GPUs the machine has:
1. NCCL accepts a symmetric window over an address range made of several physical allocations
   (NCCL 2.28 refuses: "span multiple physical segments" -- the probe reports what the loaded one does);
2. the in-place copy-engine AllGather into that range gives every rank every chunk, and its own
   chunk's pages are untouched (read back through the chunk's own mapping, too);
3. no kernel ran (copy engine) and no device-to-device copy of the own chunk (profiler).
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.distributed as dist
from probe_report import report

from wsharding.accel.nccl.binding import NCCL_UINT8, NCCL_WIN_COLL_SYMMETRIC
from wsharding.accel.nccl.communicator import NcclCommunicator
from wsharding.accel.nccl.probe import device_activity
from wsharding.accel.nccl.symmetric import wrap_device_memory

CHUNK = 64 << 20  # bytes per rank; a multiple of the allocation granularity (2 MiB on H200)


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


PINNED, POSIX_FD, DEVICE, READWRITE = 1, 1, 1, 3


class VirtualMemory:
    """The few cuMem calls the probe needs, raising on any error."""

    def __init__(self, device: int) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.prop = AllocationProp(PINNED, POSIX_FD, MemLocation(DEVICE, device), None, AllocFlags())
        self.access = AccessDesc(MemLocation(DEVICE, device), READWRITE)

    def call(self, name: str, *args) -> None:
        rc = getattr(self.cu, name)(*args)
        if rc:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def granularity(self) -> int:
        g = ctypes.c_size_t(0)
        self.call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(self.prop), 0)
        return g.value

    def create(self, nbytes: int) -> int:
        h = ctypes.c_uint64(0)
        self.call("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(nbytes), ctypes.byref(self.prop), ctypes.c_uint64(0))
        return h.value

    def reserve(self, nbytes: int) -> int:
        p = ctypes.c_uint64(0)
        self.call("cuMemAddressReserve", ctypes.byref(p), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                  ctypes.c_uint64(0), ctypes.c_uint64(0))
        return p.value

    def map(self, ptr: int, nbytes: int, handle: int) -> None:
        self.call("cuMemMap", ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                  ctypes.c_uint64(handle), ctypes.c_uint64(0))
        self.call("cuMemSetAccess", ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes), ctypes.byref(self.access),
                  ctypes.c_size_t(1))


def main() -> None:
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    dist.init_process_group("gloo")
    n = dist.get_world_size()
    dev = torch.device("cuda", local)
    comm = NcclCommunicator(None, device=dev)
    vm = VirtualMemory(local)
    out: dict = {"world_size": n, "ranks_per_gpu": comm.ranks_per_gpu, "nccl": comm.library.describe(),
                 "granularity": vm.granularity(), "chunk_bytes": CHUNK}

    # The resident chunk: its own allocation and its own address (where the weights' chunk lives).
    chunk_h = vm.create(CHUNK)
    chunk_ptr = vm.reserve(CHUNK)
    vm.map(chunk_ptr, CHUNK, chunk_h)
    chunk = wrap_device_memory(chunk_ptr, CHUNK, dev)
    chunk.fill_(rank + 1)
    # The slot's pages: one allocation per peer slice (cuMemMap maps a whole allocation from offset 0).
    peer_h = [vm.create(CHUNK) for _ in range(n - 1)]
    # The layer's view: rank r's slice -> the chunk's pages, the other slices -> the slot's pages.
    view_ptr = vm.reserve(n * CHUNK)
    peers = iter(peer_h)
    for r in range(n):
        vm.map(view_ptr + r * CHUNK, CHUNK, chunk_h if r == rank else next(peers))
    view = wrap_device_memory(view_ptr, n * CHUNK, dev)
    for r in range(n):
        if r != rank:
            view[r * CHUNK:(r + 1) * CHUNK].fill_(0xEE)
    torch.cuda.synchronize(dev)
    out["own_slice_is_the_chunk"] = bool(torch.equal(view[rank * CHUNK:(rank + 1) * CHUNK], chunk))

    win = ctypes.c_void_p(0)
    rc = comm.nccl.ncclCommWindowRegister(comm.handle, ctypes.c_void_p(view_ptr), ctypes.c_size_t(n * CHUNK),
                                          ctypes.byref(win), NCCL_WIN_COLL_SYMMETRIC)
    out["register_rc"] = rc
    out["register_error"] = "" if rc == 0 else comm.nccl.last_error(comm.handle)
    ok = all(dist_gather_ok(rc == 0, n))
    if ok:
        stream = comm.stream

        def gather() -> None:
            own = view_ptr + rank * CHUNK
            r = comm.nccl.ncclAllGather(ctypes.c_void_p(own), ctypes.c_void_p(view_ptr), ctypes.c_size_t(CHUNK),
                                        NCCL_UINT8, comm.handle, ctypes.c_void_p(stream.cuda_stream))
            if r:
                raise RuntimeError(f"ncclAllGather: {r} {comm.nccl.last_error(comm.handle)}")
            stream.synchronize()

        gather()  # the first one sets the copy-engine path up
        for r in range(n):
            if r != rank:
                view[r * CHUNK:(r + 1) * CHUNK].fill_(0xEE)
        torch.cuda.synchronize(dev)
        dist.barrier()
        act = device_activity(gather, dev)
        out["kernels"] = sorted(set(act["kernels"]))
        out["copies"] = sorted(set(act["copies"]))
        out["copy_count"] = len(act["copies"])
        got = [int(view[r * CHUNK:(r + 1) * CHUNK].min()) == r + 1 == int(view[r * CHUNK:(r + 1) * CHUNK].max())
               for r in range(n)]
        out["every_slice_right"] = all(got)
        out["chunk_untouched"] = bool((chunk == rank + 1).all())
        comm.nccl.ncclCommWindowDeregister(comm.handle, win)
    if n == 1:  # one rank: the layer view has one segment; ask about two (the chunk and a slot's pages)
        two_ptr = vm.reserve(2 * CHUNK)
        vm.map(two_ptr, CHUNK, chunk_h)
        vm.map(two_ptr + CHUNK, CHUNK, vm.create(CHUNK))
        win2 = ctypes.c_void_p(0)
        rc2 = comm.nccl.ncclCommWindowRegister(comm.handle, ctypes.c_void_p(two_ptr), ctypes.c_size_t(2 * CHUNK),
                                               ctypes.byref(win2), NCCL_WIN_COLL_SYMMETRIC)
        out["two_segment_register_rc"] = rc2
        out["two_segment_register_error"] = "" if rc2 == 0 else comm.nccl.last_error(comm.handle)
        if rc2 == 0:
            comm.nccl.ncclCommWindowDeregister(comm.handle, win2)
    everyone = [None] * n
    dist.all_gather_object(everyone, out)
    if rank == 0:
        report("layer_view_probe.json", everyone)
    comm.close()
    dist.destroy_process_group()


def dist_gather_ok(ok: bool, n: int) -> list[bool]:
    every = [None] * n
    dist.all_gather_object(every, ok)
    return every


if __name__ == "__main__":
    main()
