"""[Note: the own chunk mapped, not copied] -- the parts that need no GPU: the guards that refuse it
where it cannot work, and the pool's bookkeeping of mapped ranges (adopted, registered, undone)."""

from __future__ import annotations

import pytest
import torch

from wsharding.accel.mapped_slots import MappedSlotPolicy, mapping_page_bytes
from wsharding.accel.nccl.library import NcclLibrary, NcclLibraryError
from wsharding.accel.nccl.symmetric import WINDOW_ALIGN, SymmetricBuffer, SymmetricPool
from wsharding.core.comm import CommError, Communicator
from wsharding.core.resident import resident_formula
from wsharding.core.rowloaders import ShardingError
from wsharding.core.sharding import WeightSharding


class _PlainComm(Communicator):
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


# ---- [Note: map_own_chunk="auto"] ------------------------------------------------------------------
PAGE = 2 << 20


def _nccl(version_code: int) -> NcclLibrary:
    return NcclLibrary("/opt/nccl/libnccl.so.2", "nvidia-nccl-cu12 wheel", version_code, None)


class _Ours(_PlainComm):
    """What auto asks of our NCCL communicator: its pool, and a library that can window several allocations."""

    pool = object()
    library = _nccl(23203)
    alloc_granularity = 4096

    def slot_policy(self, map_own_chunk="auto"):
        return MappedSlotPolicy(self, map_own_chunk)  # what our NCCL communicator offers


def _blocks(rows: int, cols: int, layers: int = 3) -> list[torch.nn.Module]:
    out = []
    for _ in range(layers):
        b = torch.nn.Module()
        b.fc = torch.nn.Linear(cols, rows, bias=False)
        out.append(b)
    return out


def _auto(monkeypatch, rows: int, cols: int) -> WeightSharding:
    # the page is the GPU's allocation granularity (asked of the CUDA driver); 2 MiB on an H200
    monkeypatch.setattr("wsharding.accel.mapped_slots.mapping_page_bytes", lambda comm: PAGE)
    ws = WeightSharding(_Ours(), _blocks(rows, cols), {i: ["fc"] for i in range(3)})
    assert ws.map_own_chunk and ws.layouts[0].chunk_bytes % PAGE == 0  # tentative until setup
    return ws.setup()


def test_auto_keeps_plain_slots_where_page_padding_would_cost_more(monkeypatch):
    ws = _auto(monkeypatch, 64, 64)  # 16 KiB per layer: each chunk would be padded to a 2 MiB page
    assert not ws.map_own_chunk
    assert [lay.chunk_bytes for lay in ws.layouts.values()] == [8192] * 3  # the layouts rebuilt without pages
    # plain: three 8 KiB chunks and two 16 KiB slots; mapped would be three pages and two peer pages
    assert ws.formula_bytes() == resident_formula(ws.layouts.values(), 2, 4096, mapped=False) == 3 * 8192 + 2 * 16384
    assert ws.map_own_chunk_reason == ("own chunk copied: mapped, the 2 MiB page padding of every chunk would hold "
                                       "10.0 MiB per rank against 0.1 MiB with plain slots")


def test_auto_maps_where_it_holds_no_more(monkeypatch):
    ws = _auto(monkeypatch, 1024, 1024)  # 4 MiB per layer: 2 MiB chunks, already whole pages
    assert ws.map_own_chunk and ws.layouts[0].chunk_bytes == PAGE
    # three chunks and the peer's page of each slot, against three chunks and two 4 MiB slots
    assert ws.formula_bytes() == 3 * PAGE + 2 * PAGE
    assert resident_formula(ws.layouts.values(), 2, 4096, mapped=False) == 3 * PAGE + 2 * 2 * PAGE
    assert ws.map_own_chunk_reason == ("own chunk mapped: 10.0 MiB per rank against 14.0 MiB with plain slots, "
                                       "and no own-chunk copy per gather")


def test_auto_is_off_with_the_reason_where_mapping_cannot_run():
    plain = WeightSharding(_PlainComm(), _blocks(64, 64), {i: ["fc"] for i in range(3)})
    assert not plain.map_own_chunk and plain.layouts[0].chunk_alignment == plain.layouts[0].alignment
    assert plain.map_own_chunk_reason == ("own chunk copied: _PlainComm gathers into plain buffers (mapping needs "
                                          "comm='nccl', our NCCL communicator)")

    class OldNccl(_Ours):
        library = _nccl(22809)

    old = WeightSharding(OldNccl(), _blocks(64, 64), {i: ["fc"] for i in range(3)})
    assert not old.map_own_chunk
    assert old.map_own_chunk_reason == ("own chunk copied: NCCL 2.28.9 (nvidia-nccl-cu12 wheel) is older than 2.30.0: "
                                        "it cannot window several allocations")
    off = WeightSharding(_Ours(), _blocks(64, 64), {i: ["fc"] for i in range(3)}, map_own_chunk=False)
    assert not off.map_own_chunk and off.map_own_chunk_reason == "own chunk copied: asked for (map_own_chunk=False)"
    with pytest.raises(ShardingError, match="map_own_chunk must be True, False or 'auto', got 'yes'"):
        WeightSharding(_Ours(), map_own_chunk="yes")


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


def test_driver_tables_bind_through_one_loader():
    """Both ctypes tables (the hot path's, the virtual memory's) bind through ``bind_functions``:
    typed functions, a CUresult each (here against libc, which every machine has)."""
    import ctypes

    from wsharding.accel.cuda_driver import DriverFn, bind_functions

    class Target:
        pass

    t = Target()
    bind_functions(t, (DriverFn("abs", (ctypes.c_int,), "a function every libc has"),), "libc.so.6")
    assert t._abs(-7) == 7 and tuple(t._abs.argtypes) == (ctypes.c_int,) and t._abs.restype is ctypes.c_int


def test_virtual_memory_calls_in_order_and_name_the_one_that_fails():
    from wsharding.accel.cuda_driver import CudaDriverError
    from wsharding.accel.cuda_vmm import AccessDesc, VirtualMemory

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


def test_free_unshared_frees_only_what_no_peer_maps(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    log: list[str] = []
    keep: list = []
    pool = SymmetricPool(_Owner(log))
    page = _aligned(WINDOW_ALIGN, keep)
    pool.buffers.append(SymmetricBuffer("ws0.slot.A.page.0", 0, page.numel(), page.numel(), page.data_ptr(), page,
                                        wants_window=False))
    shared = _aligned(WINDOW_ALIGN, keep)
    pool.buffers.append(SymmetricBuffer("ws0.layer.1.chunk", 1, shared.numel(), shared.numel(), shared.data_ptr(),
                                        shared))
    # a buffer that is (or will be) a window: the peers map it, so only release() -- collective -- may free it
    with pytest.raises(CommError, match=r"\['ws0.layer.1.chunk'\] are \(or will be\) symmetric windows"):
        pool.free_unshared([page, shared])
    assert log == []
    pool.free_unshared([page])
    assert log == [f"ncclMemFree {page.data_ptr():#x}"] and pool.buffers[0].freed
    assert pool.allocated_bytes == shared.numel()


class _TrimPool:
    """The calls MappedSlotPool.trim makes on the communicator's pool, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def release(self, tensors):
        self.calls.append(("release", [t.data_ptr() for t in tensors]))

    def free_unshared(self, tensors):
        self.calls.append(("free_unshared", [t.data_ptr() for t in tensors]))


def _mapped_pool(rank: int, world: int):
    from wsharding.accel.mapped_slots import MappedSlotPool

    pool = object.__new__(MappedSlotPool)  # no GPU: the bookkeeping only
    pool.comm = type("Comm", (), {"rank": rank, "world_size": world, "pool": _TrimPool()})()
    pool.layouts = {3: type("Layout", (), {"total_bytes": 64})(), 4: None}
    pool.buffers = (torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8))
    # each rank's page of a slot in two segments (segment_bytes: cut at every chunk size of the slot)
    pool._pages = [[[torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)] for _ in range(world)]
                   for _ in range(2)]
    pool._views = {}
    return pool


def test_a_page_is_cut_at_every_chunk_size_of_its_slot():
    """cuMemMap maps an allocation whole (the first bytes of a larger one: CUDA_ERROR_NOT_SUPPORTED on an
    H200), so a layer whose chunk is smaller than the largest must find an allocation that ends there."""
    from wsharding.accel.mapped_slots import MappedSlotPool

    pool = object.__new__(MappedSlotPool)
    pool.comm = type("Comm", (), {"rank": 0, "world_size": 2})()
    mib = 1 << 20
    # a dense layer 0 smaller than the MoE layers after it (the draft model's shape), in 2 MiB pages
    pool.layouts = {i: type("Layout", (), {"chunk_bytes": c})() for i, c in enumerate([2 * mib, 6 * mib, 4 * mib, 6 * mib])}
    pool.layer_ids, pool.count = [0, 1, 2, 3], 2
    pool.slot_bytes = 12 * mib  # the largest layer: 2 ranks x 6 MiB
    assert pool.segment_bytes(0) == [2 * mib, 2 * mib, 2 * mib]  # slot A: layers 0 and 2 end at 2 and 4 MiB
    assert pool.segment_bytes(1) == [6 * mib]  # slot B: layers 1 and 3, one size: one allocation


def test_trim_gives_back_the_slot_ranges_then_this_ranks_pages_and_refuses_a_second_finalize():
    pool = _mapped_pool(rank=1, world=3)
    slots, pages = list(pool.buffers), [[list(page) for page in p] for p in pool._pages]
    ptrs = lambda s, r: [seg.data_ptr() for seg in pages[s][r]]  # noqa: E731
    with pytest.raises(ShardingError, match=r"layers \[3, 4\]: trim\(\) before finalize made their views"):
        pool.trim()  # the views are made with the chunks, at finalize: the slots are still needed
    pool._views = {3: torch.zeros(1), 4: torch.zeros(1)}
    pool.trim()
    # the windows over the slot ranges first (collective), then this rank's pages, which only they reached
    assert pool.comm.pool.calls == [("release", [b.data_ptr() for b in slots]),
                                    ("free_unshared", ptrs(0, 1) + ptrs(1, 1))]
    assert [p.data_ptr() for p in pool.resident_buffers()] == [p for s in (0, 1) for r in (0, 2) for p in ptrs(s, r)]
    pool.trim()  # once only
    assert len(pool.comm.pool.calls) == 2
    # finalize again would rebuild weights in a slot that is gone: refused, naming the layer
    with pytest.raises(ShardingError, match="layer 3: the mapped slots were trimmed after finalize"):
        pool.scratch_views(3)


def test_release_checks_only_the_windows_and_frees_local_pages_after_them(monkeypatch):
    """After trim each rank holds only the peers' pages (rank 0 page.1, rank 1 page.0): comparing them
    across ranks as windows would refuse every close. They are left out of the check, and freed after
    the windows over the ranges that map them."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    log: list[str] = []
    keep: list = []
    owner = _Owner(log)
    sent = []
    owner.exchange = lambda obj: sent.append(obj) or [obj, obj]
    pool = SymmetricPool(owner)
    page = _aligned(WINDOW_ALIGN, keep)
    pool.buffers.append(SymmetricBuffer("ws0.slot.A.page.1", 0, page.numel(), page.numel(), page.data_ptr(), page,
                                        wants_window=False))
    view = _aligned(2 * WINDOW_ALIGN, keep)
    pool.adopt(view, "ws0.slot.view.3", lambda: log.append("undo view"))
    pool.register_all()
    log.clear()
    pool.release([page, view])
    assert sent[-1] == [("ws0.slot.view.3", view.numel())]  # the page is no window: not compared
    assert log == [f"deregister {view.data_ptr():#x}", "undo view", f"ncclMemFree {page.data_ptr():#x}"]
