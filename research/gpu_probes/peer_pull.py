"""Can a rank pull its peers' resident chunks itself, with no collective and no handshake?

    torchrun --nproc-per-node N research/gpu_probes/peer_pull.py [MiB]     # JSON on rank 0 (and $OUT)

The chunks never change once finalize is done, so a layer's gather needs no agreement with the peers:
only the local gate (the slot is free). NCCL's copy-engine AllGather, captured, is a graph of 7 nodes
(its handshakes with the peers) whose launch costs the host ~12 us; a graph of plain peer copies would
be cheaper to launch, and could not wait for a peer that is gone. Per rank:

1. ``ncclMemAlloc`` a chunk (the package's chunks come from it), fill it with the rank's pattern;
2. export its allocation as a POSIX file descriptor (``cuMemRetainAllocationHandle`` +
   ``cuMemExportToShareableHandle``) and pass the descriptor to every local peer over a Unix socket
   (``SCM_RIGHTS``);
3. import the peers' descriptors, map each allocation into an address range of this process;
4. copy every peer's chunk into its slice of a local slot (``cuMemcpyDtoDAsync`` from the mapping),
   check the bytes, time the copies, and the host cost of launching them as a captured graph;
5. the peers free their chunks and their handles; the copies are repeated (the pages must live on
   while this rank's mapping holds them).
"""

from __future__ import annotations

import ctypes
import os
import socket
import statistics
import struct
import sys
import time

import torch
import torch.distributed as dist
from probe_report import report

from wsharding.accel.captured_launch import CapturedLaunch
from wsharding.accel.cuda_driver import driver
from wsharding.accel.cuda_vmm import MEM_HANDLE_POSIX_FD, VirtualMemory
from wsharding.accel.nccl.binding import NcclBinding
from wsharding.accel.nccl.library import default_library
from wsharding.accel.nccl.symmetric import wrap_device_memory

lib = ctypes.CDLL("libcuda.so.1")
export = lib.cuMemExportToShareableHandle
export.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64)
import_ = lib.cuMemImportFromShareableHandle
import_.argtypes = (ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_int)


def check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what}: CUresult {rc}")


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 218
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    dev = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    vm = VirtualMemory(dev.index)
    page = vm.granularity()
    n = (mib * 2**20 + page - 1) // page * page
    out: dict = {"world_size": world, "gpus": gpus, "chunk_bytes": n,
                 "emulation": "ranks share a GPU: peer copies are same-device copies" if world > gpus else ""}

    nccl = NcclBinding(default_library())
    p = ctypes.c_void_p()
    nccl.check(nccl.ncclMemAlloc(ctypes.byref(p), n), "ncclMemAlloc")
    chunk = wrap_device_memory(p.value, n, dev)
    chunk.copy_(torch.arange(n, dtype=torch.int64, device=dev).add_(rank * 7919).to(torch.uint8))
    torch.cuda.synchronize()

    # 2. export, pass the descriptor to every peer
    handle = vm.retain(p.value)
    fd = ctypes.c_int(-1)
    rc = export(ctypes.byref(fd), handle, MEM_HANDLE_POSIX_FD, 0)
    out["export_rc"] = rc
    if rc:
        if rank == 0:
            report("peer_pull.json", out)
        raise SystemExit(f"cuMemExportToShareableHandle of ncclMemAlloc memory: CUresult {rc}")
    tag = f"wsharding-probe-{os.environ.get('MASTER_PORT', '0')}-"
    names = [None] * world
    dist.all_gather_object(names, f"\0{tag}{rank}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(names[rank])
    listener.listen(world)
    dist.barrier()
    for peer in range(world):
        if peer != rank:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(names[peer])
                socket.send_fds(s, [struct.pack("i", rank)], [fd.value])
    peer_fds: dict[int, int] = {}
    for _ in range(world - 1):
        conn, _addr = listener.accept()
        with conn:
            msg, fds, _flags, _ = socket.recv_fds(conn, 16, 1)
            peer_fds[struct.unpack("i", msg[:4])[0]] = fds[0]
    listener.close()

    # 3. import and map
    peer_va: dict[int, int] = {}
    peer_handles: dict[int, int] = {}
    for peer, pfd in sorted(peer_fds.items()):
        h = ctypes.c_uint64(0)
        check(import_(ctypes.byref(h), ctypes.c_void_p(pfd), MEM_HANDLE_POSIX_FD), f"import from rank {peer}")
        os.close(pfd)
        va = vm.reserve(n)
        vm.map(va, n, h.value)
        peer_va[peer], peer_handles[peer] = va, h.value

    # 4. copy into a local slot, check, time
    cu = driver()
    slot = torch.empty(world * n, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)

    def pull(s: int) -> None:
        for peer, va in peer_va.items():
            cu.memcpy_dtod_async(slot.data_ptr() + peer * n, va, n, s)

    def expected(r: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=dev).add_(r * 7919).to(torch.uint8)

    def check_slot() -> bool:
        return all(torch.equal(slot[r * n:(r + 1) * n], expected(r)) for r in peer_va)

    slot.zero_()
    torch.cuda.synchronize()
    pull(stream.cuda_stream)
    torch.cuda.synchronize()
    out["pulled_equal"] = check_slot()
    graph = CapturedLaunch(stream.cuda_stream, pull, "peer pull")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times, hosts = [], []
    for _ in range(20):
        torch.cuda.synchronize()
        dist.barrier()
        start.record(stream)
        t0 = time.perf_counter()
        graph.launch(stream.cuda_stream)
        hosts.append((time.perf_counter() - t0) * 1e6)
        end.record(stream)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    out["graph_nodes_memcpy"] = len(peer_va)
    out["graph_launch_host_us"] = statistics.median(hosts)
    out["pull_ms"] = statistics.median(times)
    out["pull_GBps"] = (world - 1) * n / (out["pull_ms"] * 1e-3) / 1e9 if out["pull_ms"] else None
    direct = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pull(stream.cuda_stream)
        direct.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    out["direct_memcpy_host_us"] = statistics.median(direct)

    # 5. the peers free their chunks; this rank's mapping must keep the pages alive
    dist.barrier()
    vm.release(handle)
    nccl.check(nccl.ncclMemFree(p), "ncclMemFree")
    torch.cuda.synchronize()
    dist.barrier()
    junk = torch.full((4 * n,), 255, dtype=torch.uint8, device=dev)  # reuse what was freed, if anything
    torch.cuda.synchronize()
    dist.barrier()
    slot.zero_()
    graph.launch(stream.cuda_stream)
    torch.cuda.synchronize()
    out["pulled_equal_after_peers_freed"] = check_slot()
    del junk
    graph.destroy()
    for peer, va in peer_va.items():
        vm.unmap(va, n)
        vm.free_range(va, n)
        vm.release(peer_handles[peer])
    results = [None] * world
    dist.all_gather_object(results, {k: out[k] for k in out if k.startswith(("pulled", "graph_launch", "pull_", "direct"))})
    if rank == 0:
        out["ranks"] = results
        report(f"peer_pull_{world}ranks_{gpus}gpu.json", out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
