"""The communicator's guards that need no GPU: the CTA policy variable, CUDA required, the
registration order and its cross-rank check, the zero-copy wrapper's interface."""

from __future__ import annotations

import pytest

from wsharding.accel.nccl import communicator as C
from wsharding.accel.nccl import failures as F
from wsharding.accel.nccl import group as G
from wsharding.accel.nccl import symmetric as S
from wsharding.accel.nccl import teardown as T
from wsharding.core.comm import CommError
from wsharding.core.units import align_up


@pytest.mark.parametrize("value", [None, "", "2", "zero", "ZERO"])
def test_cta_env_accepts_unset_or_same(value):
    env = {} if value is None else {"NCCL_CTA_POLICY": value}
    C.check_cta_policy_env(2, env)


def test_cta_env_mismatch_is_refused():
    with pytest.raises(CommError, match=r"NCCL_CTA_POLICY=0 \(default\) .* overrides the CTA policy 2 \(zero\)"):
        C.check_cta_policy_env(2, {"NCCL_CTA_POLICY": "0"})
    with pytest.raises(CommError, match="unset NCCL_CTA_POLICY or set it to 0"):
        C.check_cta_policy_env(0, {"NCCL_CTA_POLICY": "2"})
    with pytest.raises(CommError, match="is not a CTA policy"):
        C.check_cta_policy_env(2, {"NCCL_CTA_POLICY": "fast"})


def test_constructor_checks_env_then_cuda(monkeypatch):
    monkeypatch.setenv("NCCL_CTA_POLICY", "1")
    with pytest.raises(CommError, match="NCCL_CTA_POLICY=1 \\(efficiency\\)"):
        C.NcclCommunicator()
    monkeypatch.delenv("NCCL_CTA_POLICY")
    with pytest.raises(CommError, match="needs CUDA and this machine has no GPU"):
        C.NcclCommunicator()
    with pytest.raises(CommError, match="cta_policy must be one of"):
        C.NcclCommunicator(cta_policy=3)


def test_mode_labels():
    import torch

    from wsharding.core.torch_backend import mode_label

    gpu = torch.device("cuda", 0)  # the labels the communicator takes from the one mode function
    assert mode_label("nccl", gpu, False, world_size=1) == "gpu-nccl-single"
    assert mode_label("nccl", gpu, True, world_size=4) == "gpu-nccl-shared"
    assert mode_label("nccl", gpu, False, world_size=8) == "gpu-nccl"


def test_registration_order_is_natural_by_tag():
    tags = ["layer.10.chunk", "layer.2.slot", "layer.2.chunk", "slot.1", "layer.1.chunk", "slot.0"]
    assert sorted(tags, key=S.tag_sort_key) == [
        "layer.1.chunk", "layer.2.chunk", "layer.2.slot", "layer.10.chunk", "slot.0", "slot.1"]


def test_registration_mismatch_between_ranks_is_an_error():
    same = [("layer.0", 4096), ("layer.1", 8192)]
    S.check_same_registration([same, list(same), list(same)])
    with pytest.raises(CommError, match=r"position 1: rank 0 has \('layer.1', 8192\), rank 2 has \('layer.1', 12288\)"):
        S.check_same_registration([same, same, [("layer.0", 4096), ("layer.1", 12288)]])
    with pytest.raises(CommError, match=r"position 2: rank 0 has None, rank 1 has \('slot.0', 4096\)"):
        S.check_same_registration([same, same + [("slot.0", 4096)]])


def test_round_up_to_window_alignment():
    assert [align_up(n, S.WINDOW_ALIGN) for n in (1, 4096, 4097, 8192)] == [4096, 4096, 8192, 8192]


def test_device_memory_interface():
    cai = S.DeviceMemory(0x7F0000001000, 12345).__cuda_array_interface__
    assert cai == {"shape": (12345,), "typestr": "|u1", "data": (0x7F0000001000, False), "version": 3,
                   "strides": None, "stream": None}


def test_gloo_group_for_gloo_world_is_the_world():
    class Ctx:
        backend, world_size, store = "gloo", 4, {}

    assert G.gloo_group_for(Ctx()) is None


class _StuckAbortBinding:
    """An NCCL binding whose ncclCommAbort does not return until released: what NCCL 2.28 does while
    a copy-engine gather is stuck on the GPU ([Note: abort with a stuck gather])."""

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.aborted: list[int] = []

    def ncclCommAbort(self, handle: int) -> int:
        self.aborted.append(handle)
        self.release.wait(30)
        return 0


class _Pool:
    def __init__(self) -> None:
        self.buffers: list = []
        self.freed = self.deregistered = False

    def free_all(self) -> None:
        self.freed = True

    def deregister_all(self) -> None:
        self.deregistered = True


def _bare_comm(binding) -> C.NcclCommunicator:
    """A communicator object without init (no GPU here): only what abort and teardown touch."""
    import threading

    from wsharding.accel.nccl.graphs import CapturedGraphs

    c = object.__new__(C.NcclCommunicator)
    c.handle, c.aborted, c.closed, c.rank = 0x1234, False, False, 0
    c.watchdog, c.nccl, c.pool = None, binding, _Pool()
    c.graphs, c.teardown, c.gather_launch = CapturedGraphs(threading.RLock()), T.Teardown(c), "direct"
    c.abort_wait_s = 0.2
    return c


def test_abort_that_does_not_return_leaves_the_memory_and_the_caller_goes_on():
    import time

    binding = _StuckAbortBinding()
    c = _bare_comm(binding)
    t0 = time.monotonic()
    c.abort()  # called inline, as before, this would wait for the stuck abort: the test would time out
    assert time.monotonic() - t0 < 5 and binding.aborted == [0x1234] and c.aborted
    assert c.leaked
    c.close()  # freeing memory a stuck stream still addresses could hang too: it is left to the exit
    assert c.closed and not c.pool.freed and c.handle is None
    binding.release.set()
    c.teardown.abort_thread.join(5)
    assert not c.leaked


def test_abort_that_returns_frees_the_memory_at_close():
    binding = _StuckAbortBinding()
    binding.release.set()
    c = _bare_comm(binding)
    c.abort()
    assert not c.leaked
    c.close()
    assert c.pool.freed


def test_close_with_a_peer_gone_aborts_instead_of_deregistering(monkeypatch):
    """Deregistration is collective (and blocking on a blocking communicator): close agrees over gloo
    first, and a failed exchange -- a peer that is gone -- turns the close into an abort."""
    binding = _StuckAbortBinding()
    binding.release.set()
    c = _bare_comm(binding)
    c.synchronize = lambda: None

    def peer_gone(_obj):
        raise RuntimeError("[gloo] Connection closed by peer")

    c.exchange = peer_gone
    c.close()
    assert c.aborted and binding.aborted == [0x1234] and not c.pool.deregistered and c.pool.freed
    c2 = _bare_comm(_StuckAbortBinding())
    c2.synchronize = lambda: None
    c2.exchange = lambda obj: [obj, obj]
    c2.nccl.ncclCommFinalize = lambda h: 0
    c2.nccl.ncclCommDestroy = lambda h: 0
    c2.complete = lambda rc, what: None
    c2.nccl.check = lambda rc, what: rc
    import torch

    c2.device = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    c2.close()  # every rank is there: the collective deregistration, then finalize
    assert c2.pool.deregistered and c2.pool.freed and not c2.aborted


def test_a_raised_watchdog_error_keeps_the_process_and_an_unraised_one_ends_it(monkeypatch):
    """[Note: a host held behind a stuck gather]: the watchdog ends the process only when the host
    never came for the error -- the hot path's ``raise_if_failed`` marks it delivered."""
    from wsharding.accel.nccl.watchdog import Watchdog

    ended: list[str] = []
    monkeypatch.setattr(F, "end_process", ended.append)
    c = _bare_comm(_StuckAbortBinding())
    c.world_size, c.mode = 2, "gpu-nccl"
    c.watchdog = Watchdog(lambda: "NCCL reported remote process exited", lambda m: None, timeout_s=5.0,
                          period_s=3600, on_stuck=c.end_stuck_process, stuck_after_s=0.01)
    try:
        c.watchdog.check_once()
        with pytest.raises(C.CommError, match=r"layer 4: gather on rank 0 of 2 \(gpu-nccl\): NCCL reported"):
            c.raise_if_failed("layer 4: gather")
        assert c.watchdog.escalate_if_stuck() is False and ended == []
        c.watchdog.delivered = False  # the host never reached a planner call: held in a CUDA sync
        assert c.watchdog.escalate_if_stuck() is True
        assert len(ended) == 1 and ended[0].startswith("rank 0 of 2 (gpu-nccl): NCCL reported remote process exited; "
                                                       "no call through the communicator came back")
    finally:
        c.watchdog.stop()


# ---- a call that fails: the communicator is aborted and the error names the call -------------------
class _ScriptedBinding(_StuckAbortBinding):
    """NCCL calls answered from a script: ``async_states`` is what ``ncclCommGetAsyncError`` reports,
    one per poll (the last one repeats); ``gather_rc`` what ``ncclAllGather`` returns."""

    def __init__(self, async_states=(0,), async_rc: int = 0, gather_rc: int = 0) -> None:
        super().__init__()
        self.release.set()
        self.async_states, self.async_rc, self.gather_rc = list(async_states), async_rc, gather_rc
        self.gathers = 0

    def ncclCommGetAsyncError(self, handle, ref) -> int:
        ref._obj.value = self.async_states.pop(0) if len(self.async_states) > 1 else self.async_states[0]
        return self.async_rc

    def ncclAllGather(self, *args) -> int:
        self.gathers += 1
        return self.gather_rc

    def error_string(self, rc: int) -> str:
        return {1: "unhandled cuda error", 5: "invalid usage", 6: "remote process exited"}.get(rc, "?")

    def last_error(self, handle) -> str:
        return "peer 1 is gone"

    def check(self, rc: int, what: str, comm=None, **_) -> int:
        if rc != 0:
            raise C.NcclError(what, rc, self.error_string(rc))
        return rc


def _scripted_comm(**script) -> C.NcclCommunicator:
    import threading

    c = _bare_comm(_ScriptedBinding(**script))
    c.world_size, c.mode, c.timeout_s, c.lock = 2, "gpu-nccl", 5.0, threading.Lock()
    return c


def test_a_failed_call_aborts_and_every_later_call_says_so():
    c = _scripted_comm()
    with pytest.raises(C.NcclError, match=r"layer 3: gather failed: .* \(1\): unhandled cuda error -- NCCL says: "
                                          r"peer 1 is gone"):
        c.fail(1, "layer 3: gather")
    assert c.aborted and c.nccl.aborted == [0x1234]
    # without the abort flag the next gather would go to a communicator NCCL has given up on
    with pytest.raises(CommError, match="layer 4: the NCCL communicator of rank 0 is aborted"):
        c.raise_if_failed("layer 4")
    with pytest.raises(CommError, match="NCCL communicator of rank 0 is aborted"):
        c.alloc(4096)
    c.release([object()])  # the memory went with the communicator: nothing to deregister (_Pool has no release)


def test_complete_polls_until_done_and_a_refused_call_aborts():
    c = _scripted_comm(async_states=(7, 7, 0))
    c.complete(0, "ncclCommInitRankConfig")  # in progress twice, then done
    assert not c.aborted and c.nccl.async_states == [0]
    with pytest.raises(C.NcclError, match=r"ncclCommFinalize failed: .* \(5\): invalid usage"):
        c.complete(5, "ncclCommFinalize")
    assert c.aborted
    c = _scripted_comm(async_states=(7, 6))
    with pytest.raises(C.NcclError, match=r"register layer.2 failed: .* \(6\): remote process exited -- NCCL says"):
        c.complete(7, "register layer.2")  # the async state turned into an error while it was polled
    assert c.aborted


def test_a_launch_that_never_finishes_or_fails_is_an_error_not_a_spin_forever():
    c = _scripted_comm(async_states=(7, 7, 0))
    c.spin_until_launched("layer 1: gather")
    assert not c.aborted
    c = _scripted_comm(async_states=(7, 1))
    with pytest.raises(C.NcclError, match=r"layer 1: gather failed: .* \(1\): unhandled cuda error"):
        c.spin_until_launched("layer 1: gather")
    assert c.aborted
    c = _scripted_comm(async_rc=5)
    with pytest.raises(C.NcclError, match="ncclCommGetAsyncError after layer 1: gather failed"):
        c.spin_until_launched("layer 1: gather")
    c = _scripted_comm(async_states=(7,))
    c.timeout_s = 0.0  # the deadline is checked every 4096 polls: two checks, then the error
    with pytest.raises(C.CommTimeout, match="layer 1: gather on rank 0: NCCL did not finish launching it within 0.0 s"):
        c.spin_until_launched("layer 1: gather")
    assert c.aborted


def test_the_watchdog_reads_an_async_error_as_text_and_nothing_once_aborted():
    c = _scripted_comm(async_states=(0,))
    assert c.async_error_text() is None
    c.nccl.async_states = [6]
    assert c.async_error_text() == "NCCL reported remote process exited (6): peer 1 is gone"
    c.abort_from_watchdog("overdue")
    assert c.aborted and c.async_error_text() is None  # an aborted communicator is not asked again


def test_interpreter_exit_closes_every_live_communicator_past_one_that_fails(monkeypatch):
    import weakref

    closed: list[str] = []

    class Live:
        def __init__(self, name: str, fails: bool) -> None:
            self.name, self.fails = name, fails

        def close(self) -> None:
            closed.append(self.name)
            if self.fails:
                raise RuntimeError("CUDA driver shutting down")

    live = [Live("a", True), Live("b", False)]
    monkeypatch.setattr(T, "_LIVE", weakref.WeakSet(live))
    T._close_all()
    assert sorted(closed) == ["a", "b"]


# ---- the prepared gather's failures (no GPU: the driver and the communicator are stand-ins) --------
class _Driver:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        return lambda *a: self.calls.append(name)


class _Event:
    cuda_event = 0xE


def _prepared(comm) -> object:
    from wsharding.accel.nccl.gather import NcclPreparedGather
    from wsharding.accel.nccl.watchdog import Watchdog

    g = object.__new__(NcclPreparedGather)
    g.comm, g.what, g.nbytes, g.in_place, g.in_progress_launches = comm, "layer 5: gather", 4096, False, 0
    g._own_ptr = g._chunk_ptr = g._full_ptr = 0x1000
    g._copied_ev = g._ready_ev = 0xE
    g._copy_stream, g._gather_stream, g._cu = 1, 2, _Driver()
    g.copied = g.ready = _Event()
    g._graph = g._launch_graph = g._copy_graph = g._launch_copy_graph = None
    g._peers_only, g._with_peers = False, True
    g.program = g.program_for = g.seq_for = None
    g.seq = 0
    comm.watchdog = Watchdog(lambda: None, lambda m: None, timeout_s=5.0, period_s=3600)
    comm.copy_stream = comm.stream = None
    comm.gathers_issued = 0
    return g


@pytest.fixture
def no_capture(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_a_gather_refused_by_nccl_aborts_and_names_the_layer(no_capture):
    c = _scripted_comm(gather_rc=1)
    g = _prepared(c)
    try:
        with pytest.raises(C.NcclError, match=r"layer 5: gather failed: .* unhandled cuda error -- NCCL says: peer 1"):
            g.start()
        assert c.aborted and c.gathers_issued == 0
        # the own-chunk copy was queued before NCCL refused: it is harmless, the slot is not read
        assert g._cu.calls == ["memcpy_dtod_async", "event_record", "stream_wait_event"]
        with pytest.raises(CommError, match="layer 5: gather: the NCCL communicator of rank 0 is aborted"):
            g.start()  # the next layer's gather does not reach NCCL
        assert c.nccl.gathers == 1
    finally:
        c.watchdog.stop()


def test_a_gather_after_the_watchdog_found_an_error_raises_it(no_capture):
    c = _scripted_comm()
    g = _prepared(c)
    try:
        c.watchdog.error = "layer 2: gather did not complete within 5.0 s"
        with pytest.raises(CommError, match=r"layer 5: gather on rank 0 of 2 \(gpu-nccl\): layer 2: gather did not "
                                            r"complete within 5.0 s; the NCCL communicator was aborted"):
            g.start()
        assert c.watchdog.delivered and g._cu.calls == [] and c.nccl.gathers == 0
    finally:
        c.watchdog.stop()


def test_a_launch_handed_to_nccls_thread_is_waited_for_before_ready_is_recorded(no_capture):
    c = _scripted_comm(async_states=(7, 7, 0), gather_rc=7)
    g = _prepared(c)
    try:
        g.start()
        assert g.in_progress_launches == 1 and c.nccl.async_states == [0] and c.gathers_issued == 1
        assert g._cu.calls[-1] == "event_record"  # `ready`, after the launch finished
    finally:
        c.watchdog.stop()


# ---- the copy-engine probe's log helpers -------------------------------------------------------------
def test_nccl_log_helpers(tmp_path, monkeypatch):
    import os

    from wsharding.accel.nccl import probe

    env = probe.log_environment(str(tmp_path))
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%h.%p.log")}
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    assert probe.own_log_text() == ""
    monkeypatch.setenv("NCCL_DEBUG_FILE", env["NCCL_DEBUG_FILE"])
    assert probe.own_log_text() == ""  # no log written yet
    log = tmp_path / f"nccl.{os.uname().nodename}.{os.getpid()}.log"
    log.write_text("x:1:1 NCCL INFO Comm config CTA policy flags set to 2\nother\n"
                   "x:1:1 NCCL INFO Comm config CTA policy flags set to 0\n")
    assert probe.policies_in_log(probe.own_log_text()) == [2, 0]


# ---- [Note: a gather launched as a graph] (no GPU: a scripted graph driver) ---------------------------
class _GraphDriver:
    """The driver's graph calls, scripted: results by name, every call logged."""

    def __init__(self, log: list[str], fail: dict[str, int] | None = None) -> None:
        self.log, self.fail = log, fail or {}
        from wsharding.accel.cuda_driver import GRAPH_FUNCTIONS

        for fn in GRAPH_FUNCTIONS:
            setattr(self, "_" + fn.name, self._call(fn.name))

    def _call(self, name: str):
        def call(*args) -> int:
            self.log.append(name)
            if name == "cuStreamEndCapture":
                args[1]._obj.value = 0x6A
            if name == "cuGraphInstantiateWithFlags":
                args[0]._obj.value = 0xE7
            return self.fail.get(name, 0)

        return call


def test_a_captured_launch_records_once_and_launches_with_one_call():
    from wsharding.accel.captured_launch import CapturedLaunch

    log: list[str] = []
    launch = CapturedLaunch(7, lambda stream: log.append(f"record on {stream}"), "layer 1: gather",
                            cu=_GraphDriver(log))
    assert log == ["cuStreamBeginCapture_v2", "record on 7", "cuStreamEndCapture", "cuGraphInstantiateWithFlags",
                   "cuGraphUpload"]
    log.clear()
    launch.launch(7)
    launch.launch(7)
    assert log == ["cuGraphLaunch", "cuGraphLaunch"]  # the recorded work never runs again on the host
    log.clear()
    launch.destroy()
    launch.destroy()
    assert log == ["cuGraphExecDestroy", "cuGraphDestroy"] and not launch.alive


def test_two_threads_destroying_one_graph_free_it_once():
    """A sharding closing while the abort thread frees every graph: a double cuGraphExecDestroy would be
    undefined behaviour in the driver. The check and the release happen under one lock: a second thread
    waits for it (shown by holding the lock here), then finds the graph gone."""
    import threading
    import time

    from wsharding.accel.captured_launch import CapturedLaunch

    log: list[str] = []
    launch = CapturedLaunch(7, lambda s: None, "layer 4: gather", cu=_GraphDriver(log))
    log.clear()
    with launch._destroy_lock:  # another thread inside destroy()
        t = threading.Thread(target=launch.destroy)
        t.start()
        time.sleep(0.05)
        assert log == []  # without the lock it would have freed the graph already, under the other's feet
    t.join(5)
    launch.destroy()
    assert log == ["cuGraphExecDestroy", "cuGraphDestroy"]


def test_a_capture_whose_recording_fails_still_ends_the_capture():
    from wsharding.accel.captured_launch import CapturedLaunch

    log: list[str] = []

    def refused(stream: int) -> None:
        raise C.NcclError("layer 2: gather", 5, "invalid usage")

    with pytest.raises(C.NcclError, match="layer 2: gather"):
        CapturedLaunch(7, refused, "layer 2: gather", cu=_GraphDriver(log))
    # without ending it, the stream would stay in capture mode and every later call on it would fail
    assert log == ["cuStreamBeginCapture_v2", "cuStreamEndCapture"]


def test_a_failed_graph_call_names_the_gather_and_the_call():
    from wsharding.accel.captured_launch import CapturedLaunch
    from wsharding.accel.cuda_driver import CudaDriverError

    with pytest.raises(CudaDriverError, match=r"layer 3: gather: cuGraphInstantiate failed with CUresult 1"):
        CapturedLaunch(7, lambda s: None, "layer 3: gather", cu=_GraphDriver([], {"cuGraphInstantiateWithFlags": 1}))
    launch = CapturedLaunch(7, lambda s: None, "layer 3: gather", cu=_GraphDriver([], {"cuGraphLaunch": 700}))
    with pytest.raises(CudaDriverError, match=r"layer 3: gather: cuGraphLaunch failed with CUresult 700"):
        launch.launch(7)


def _graph_gather(c, log, fail=None):
    from wsharding.accel.captured_launch import CapturedLaunch

    g = _prepared(c)
    g._graph = g._launch_graph = CapturedLaunch(2, g._nccl_gather, g.what, cu=_GraphDriver(log, fail))
    c.graphs.keep(g._graph)
    return g


def test_a_gather_with_a_graph_launches_it_instead_of_calling_nccl(no_capture):
    c = _scripted_comm()
    log: list[str] = []
    g = _graph_gather(c, log)
    try:
        assert c.nccl.gathers == 1 and g.launch == "graph"  # the one call, made during the capture
        for _ in range(3):
            g.start()
        assert c.nccl.gathers == 1 and log.count("cuGraphLaunch") == 3 and c.gathers_issued == 3
        g.launch = "direct"  # what bench step compares against
        g.start()
        assert c.nccl.gathers == 2 and log.count("cuGraphLaunch") == 3
        g.launch = "graph"
        g.close()
        assert len(c.graphs) == 0 and log[-2:] == ["cuGraphExecDestroy", "cuGraphDestroy"] and g.launch == "direct"
        with pytest.raises(ValueError, match="no captured graph to launch"):
            g.launch = "graph"
    finally:
        c.watchdog.stop()


def test_the_own_chunk_copy_is_launched_as_its_graph_too(no_capture):
    from wsharding.accel.captured_launch import CapturedLaunch

    c = _scripted_comm()
    log: list[str] = []
    g = _prepared(c)
    g._copy_graph = g._launch_copy_graph = CapturedLaunch(1, g._copy_own_chunk, g.what, cu=_GraphDriver(log))
    try:
        assert g._cu.calls == ["memcpy_dtod_async"]  # recorded once, into the graph, on the copy stream
        g.start()
        assert g._cu.calls[1:] == ["event_record", "stream_wait_event", "event_record"]  # no copy call
        assert log.count("cuGraphLaunch") == 1 and g.launch == "graph"
        g.launch = "direct"
        g.start()
        assert g._cu.calls[4] == "memcpy_dtod_async" and log.count("cuGraphLaunch") == 1
    finally:
        c.watchdog.stop()


def test_inside_a_capture_of_the_whole_step_the_gather_records_ncclAllGather(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    c = _scripted_comm()
    log: list[str] = []
    g = _graph_gather(c, log)
    try:
        g.start()  # a graph launched into a capture would nest; NCCL's own launch is what a capture records
        assert c.nccl.gathers == 2 and "cuGraphLaunch" not in log
    finally:
        c.watchdog.stop()


def test_a_failed_graph_launch_aborts_and_names_the_layer(no_capture):
    c = _scripted_comm()
    g = _graph_gather(c, [], {"cuGraphLaunch": 700})
    try:
        with pytest.raises(CommError, match=r"^layer 5: gather: cuGraphLaunch failed with CUresult 700( \([^)]*\))? on rank 0; "
                                            r"the NCCL communicator was aborted"):
            g.start()
        assert c.aborted and c.gathers_issued == 0
    finally:
        c.watchdog.stop()


def test_in_place_with_peers_the_gather_stream_waits_for_the_gate_itself(no_capture):
    c = _scripted_comm()
    g = _prepared(c)
    g.in_place = g._peers_only = True
    try:
        g.start(_Event())
        # no copy stream at all: the wait for the gate, the gather, the ready record, all on stream 2
        assert g._cu.calls == ["stream_wait_event", "event_record"] and c.nccl.gathers == 1
    finally:
        c.watchdog.stop()


def test_the_graphs_go_before_the_communicator_at_close_and_at_abort(monkeypatch):
    """NCCL's destroy and abort wait until no graph references the communicator: a graph left alive
    would hold close (or the abort thread) forever."""
    from wsharding.accel.captured_launch import CapturedLaunch

    log: list[str] = []
    c = _bare_comm(_StuckAbortBinding())
    c.synchronize = lambda: None
    c.exchange = lambda obj: [obj, obj]
    c.pool.deregister_all = lambda: log.append("deregister windows")
    c.nccl.ncclCommFinalize = lambda h: log.append("ncclCommFinalize") or 0
    c.nccl.ncclCommDestroy = lambda h: log.append("ncclCommDestroy") or 0
    c.complete = lambda rc, what: None
    c.nccl.check = lambda rc, what: rc
    import torch

    c.device = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    c.graphs.keep(CapturedLaunch(2, lambda s: None, "layer 0: gather", cu=_GraphDriver(log)))
    log.clear()
    c.close()
    assert log == ["cuGraphExecDestroy", "cuGraphDestroy", "deregister windows", "ncclCommFinalize", "ncclCommDestroy"]

    binding = _StuckAbortBinding()
    binding.release.set()
    c2 = _bare_comm(binding)
    log.clear()
    c2.graphs.keep(CapturedLaunch(2, lambda s: None, "layer 0: gather", cu=_GraphDriver(log)))
    real_abort = binding.ncclCommAbort
    binding.ncclCommAbort = lambda h: log.append("ncclCommAbort") or real_abort(h)
    log.clear()
    c2.abort()
    c2.teardown.abort_thread.join(5)
    assert log == ["cuGraphExecDestroy", "cuGraphDestroy", "ncclCommAbort"] and len(c2.graphs) == 0


def test_an_unknown_gather_launch_is_refused_before_anything_else():
    with pytest.raises(CommError, match=r"gather_launch must be one of \('graph', 'direct'\), got 'eager'"):
        C.NcclCommunicator(gather_launch="eager")


def test_the_issue_thread_is_a_plug_in_nothing_imports_until_it_is_switched_on():
    """[Note: the issue thread]: an opt-in acceleration; the communicator and its gathers run without
    its module (and its C compiler) unless it is asked for."""
    import subprocess
    import sys

    code = ("import sys, wsharding.accel.nccl.communicator, wsharding.accel.nccl.gather; "
            "print(sorted(m for m in sys.modules if m.endswith(('issue_thread', 'issuing'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
