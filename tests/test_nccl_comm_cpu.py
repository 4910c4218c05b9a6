"""The communicator's guards that need no GPU: the CTA policy variable, CUDA required, the
registration order and its cross-rank check, the zero-copy wrapper's interface."""

from __future__ import annotations

import pytest

from wsharding.comm.base import CommError
from wsharding.comm.nccl import communicator as C
from wsharding.comm.nccl import symmetric as S
from wsharding.units import align_up


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
    assert C.mode_of(1, False) == "gpu-nccl-single"
    assert C.mode_of(4, True) == "gpu-nccl-shared"
    assert C.mode_of(8, False) == "gpu-nccl"


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

    assert C.gloo_group_for(Ctx()) is None


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
    c = object.__new__(C.NcclCommunicator)
    c.handle, c.aborted, c.closed, c.rank = 0x1234, False, False, 0
    c._abort_thread, c.watchdog, c.nccl, c.pool, c._on_close = None, None, binding, _Pool(), []
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
    c._abort_thread.join(5)
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
    from wsharding.comm.nccl.watchdog import Watchdog

    ended: list[str] = []
    monkeypatch.setattr(C, "end_process", ended.append)
    c = _bare_comm(_StuckAbortBinding())
    c.world_size, c.mode = 2, "gpu-nccl"
    c.watchdog = Watchdog(lambda: "NCCL reported remote process exited", lambda m: None, timeout_s=5.0,
                          period_s=3600, on_stuck=c._end_stuck_process, stuck_after_s=0.01)
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
