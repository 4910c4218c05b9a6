"""[Note: the own chunk mapped, not copied] -- the parts that need no GPU: the guards that refuse it
where it cannot work, and the pool's bookkeeping of mapped ranges (adopted, registered, undone)."""

from __future__ import annotations

import pytest
import torch

from wsharding.comm.base import CommError
from wsharding.comm.nccl.library import NcclLibrary, NcclLibraryError
from wsharding.comm.nccl.symmetric import WINDOW_ALIGN, SymmetricBuffer, SymmetricPool
from wsharding.mapped_slots import mapping_page_bytes
from wsharding.rowloaders import ShardingError
from wsharding.shard import WeightSharding


class _PlainComm:
    rank, world_size, device = 0, 2, torch.device("cpu")


def test_map_own_chunk_needs_our_nccl_communicator():
    with pytest.raises(ShardingError, match=r"map_own_chunk=True needs our NCCL communicator .* _PlainComm gathers"):
        mapping_page_bytes(_PlainComm())
    with pytest.raises(ShardingError, match="map_own_chunk=True needs our NCCL communicator"):
        WeightSharding(_PlainComm(), map_own_chunk=True)  # refused before anything is declared


def test_the_version_gate_refuses_an_nccl_that_would_share_only_the_first_allocation():
    """NCCL 2.28 registers a window over several allocations but maps only the first for the peers
    (its dev_runtime.cc): a peer's gather would write past what it mapped. Without the gate nothing
    says so until the output is wrong or the GPU faults."""

    class Comm(_PlainComm):
        pool = object()
        library = NcclLibrary("/opt/nccl/libnccl.so.2", "nvidia-nccl-cu13 2.28.9 wheel", 22809, None)

    with pytest.raises(NcclLibraryError, match=r"map_own_chunk .* needs NCCL >= 2\.30\.0, but the library loaded is "
                                               r"NCCL 2\.28\.9 from /opt/nccl/libnccl\.so\.2"):
        mapping_page_bytes(Comm())


class _Binding:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def ncclCommWindowRegister(self, handle, ptr, nbytes, ref, flags) -> int:
        self.log.append(f"register {ptr:#x}")
        ref._obj.value = ptr
        return 0

    def ncclCommWindowDeregister(self, handle, win) -> int:
        self.log.append(f"deregister {win:#x}")
        return 0

    def ncclMemFree(self, ptr) -> int:
        self.log.append(f"ncclMemFree {ptr:#x}")
        return 0

    def error_string(self, rc: int) -> str:
        return "?"


class _Owner:
    handle, device = 0x1, torch.device("cpu")

    def __init__(self, log: list[str]) -> None:
        self.nccl = _Binding(log)

    def exchange(self, obj):
        return [obj, obj]

    def complete(self, rc: int, what: str) -> None:
        assert rc == 0


def _aligned(nbytes: int, backing: list) -> torch.Tensor:
    raw = torch.zeros(nbytes + WINDOW_ALIGN, dtype=torch.uint8)
    backing.append(raw)
    skip = -raw.data_ptr() % WINDOW_ALIGN
    return raw.narrow(0, skip, nbytes)


def test_pool_registers_adopted_ranges_not_their_pages_and_undoes_them_first(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # release drains the GPU first
    log: list[str] = []
    keep: list = []
    pool = SymmetricPool(_Owner(log))
    page = _aligned(2 * WINDOW_ALIGN, keep)
    # a page as MappedSlotPool makes it: ncclMemAlloc memory reached only through the ranges
    pool.buffers.append(SymmetricBuffer("ws0.slot.A.page.1", 0, page.numel(), page.numel(), page.data_ptr(), page,
                                        wants_window=False))
    slot, view = _aligned(4 * WINDOW_ALIGN, keep), _aligned(4 * WINDOW_ALIGN, keep)
    pool.adopt(slot, "ws0.slot.A", lambda: log.append("undo slot"))
    pool.adopt(view, "ws0.slot.view.3", lambda: log.append("undo view"))
    assert [b.tag for b in pool.pending()] == ["ws0.slot.A", "ws0.slot.view.3"]  # the page gets no window
    assert pool.register_all() == 2
    assert pool.allocated_bytes == page.numel()  # a mapped range owns no memory: counted once, as its pages
    assert pool.window_of(view.narrow(0, WINDOW_ALIGN, 16)).tag == "ws0.slot.view.3"
    log.clear()
    pool.release([view])
    assert log == [f"deregister {view.data_ptr():#x}", "undo view"]  # never ncclMemFree on a mapped range
    log.clear()
    pool.free_all()
    # ranges first: unmapped before the pages under them are freed
    assert log == ["undo slot", f"ncclMemFree {page.data_ptr():#x}"]
    with pytest.raises(CommError, match="are not whole 4096-byte units"):
        pool.adopt(_aligned(100, keep), "ws0.odd", lambda: None)
    with pytest.raises(CommError, match="tag 'ws0.slot.view.4' is already used"):
        pool.adopt(_aligned(WINDOW_ALIGN, keep), "ws0.slot.view.4", lambda: None)
        pool.adopt(_aligned(WINDOW_ALIGN, keep), "ws0.slot.view.4", lambda: None)


def test_bench_step_mapped_variant_on_cpu_ranks_says_why_not(cluster_of):
    from wsharding.lab.bench.step import step_bench_rank

    with pytest.raises(Exception, match="map_own_chunk=True needs our NCCL communicator"):
        cluster_of(2).run(step_bench_rank, "tiny", [1], steps=1, warmup=0, fsdp=False, mapped=True)


def test_driver_tables_bind_through_one_loader():
    """Both ctypes tables (the hot path's, the virtual memory's) bind through ``bind_functions``:
    typed functions, a CUresult each (here against libc, which every machine has)."""
    import ctypes

    from wsharding.comm.cuda_driver import DriverFn, bind_functions

    class Target:
        pass

    t = Target()
    bind_functions(t, (DriverFn("abs", (ctypes.c_int,), "a function every libc has"),), "libc.so.6")
    assert t._abs(-7) == 7 and tuple(t._abs.argtypes) == (ctypes.c_int,) and t._abs.restype is ctypes.c_int


def test_virtual_memory_calls_in_order_and_name_the_one_that_fails():
    from wsharding.comm.cuda_driver import CudaDriverError
    from wsharding.comm.cuda_vmm import AccessDesc, VirtualMemory

    calls: list[str] = []
    vm = object.__new__(VirtualMemory)  # no libcuda here: the driver's functions are stand-ins
    vm._access = AccessDesc()
    for name in ("cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"):
        setattr(vm, "_" + name, lambda *a, name=name: calls.append(name) or 0)
    vm.map(0x200000, 4 << 20, 0x77)
    vm.unmap(0x200000, 4 << 20)
    vm.free_range(0x200000, 4 << 20)
    vm.release(0x77)
    # access is granted right after each mapping: a range mapped without it faults on first use
    assert calls == ["cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"]
    vm._cuMemMap = lambda *a: 2  # CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaDriverError, match=r"cuMemMap\(0x200000, 4194304\) failed with CUresult 2"):
        vm.map(0x200000, 4 << 20, 0x77)
