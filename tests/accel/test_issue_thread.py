"""The issue thread's queue (wsharding/accel/issue_thread.c), driven by a recording driver.

The thread only calls the three function pointers it is given, so on a machine without a GPU a
small C file stands in for cuStreamWaitEvent / cuGraphLaunch / cuEventRecord: it logs each call (and
can fail at a chosen one, or take a while), and the tests read the log back. The GPU tests
(``tests/models/test_gpu_sharding.py``) run the same thread against the real driver.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading

import pytest

from wsharding.accel import issue_thread as it

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="needs a C compiler")

RECORDER = r"""
#include <stdint.h>
#include <time.h>
#define N 65536
int64_t log_kind[N], log_a[N], log_b[N];
volatile int64_t n_calls = 0;
int64_t fail_at = -1;   /* the call index that returns an error */
double slow_us = 0;     /* how long each call takes */
static void take(void) {
    if (slow_us <= 0) return;
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    double end = t.tv_sec * 1e6 + t.tv_nsec * 1e-3 + slow_us, now;
    do { clock_gettime(CLOCK_MONOTONIC, &t); now = t.tv_sec * 1e6 + t.tv_nsec * 1e-3; } while (now < end);
}
static int log_call(int64_t kind, void *a, void *b) {
    take();
    int64_t i = n_calls;
    log_kind[i] = kind; log_a[i] = (int64_t)a; log_b[i] = (int64_t)b;
    n_calls = i + 1;
    return i == fail_at ? 700 : 0;
}
int rec_wait(void *stream, void *event, unsigned flags) { return log_call(1, stream, event); }
int rec_launch(void *exec, void *stream) { return log_call(3, exec, stream); }
int rec_record(void *event, void *stream) { return log_call(4, event, stream); }
"""


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    d = tmp_path_factory.mktemp("recorder")
    (d / "rec.c").write_text(RECORDER)
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-O1", "-shared", "-fPIC", str(d / "rec.c"), "-o", str(d / "rec.so")], check=True)
    return ctypes.CDLL(str(d / "rec.so"))


def fresh(rec, *, fail_at: int = -1, slow_us: float = 0.0, spin_us: float = 50.0) -> it.IssueThread:
    ctypes.c_int64.in_dll(rec, "n_calls").value = 0
    ctypes.c_int64.in_dll(rec, "fail_at").value = fail_at
    ctypes.c_double.in_dll(rec, "slow_us").value = slow_us
    return it.IssueThread(wait=it.fn_address(rec.rec_wait), launch=it.fn_address(rec.rec_launch),
                          record=it.fn_address(rec.rec_record), spin_us=spin_us, name="test issue thread")


def calls(rec) -> list[tuple[int, int, int]]:
    n = ctypes.c_int64.in_dll(rec, "n_calls").value
    kind = (ctypes.c_int64 * 65536).in_dll(rec, "log_kind")
    a = (ctypes.c_int64 * 65536).in_dll(rec, "log_a")
    b = (ctypes.c_int64 * 65536).in_dll(rec, "log_b")
    return [(kind[i], a[i], b[i]) for i in range(n)]


def layer_program(layer: int) -> it.Program:
    """What a peers-only gather issues: wait for the gate on G, launch the layer's graph, record ready."""
    g = 0x1000
    return it.IssueThread.program([(it.OP_WAIT_GATE, g, 0), (it.OP_LAUNCH, 0x100 + layer, g),
                                   (it.OP_RECORD, 0x200 + layer, g)])


def test_programs_run_in_push_order_with_each_push_gate(recorder):
    q = fresh(recorder, spin_us=0.0)  # sleeps between pushes: every push wakes it
    progs = [layer_program(i) for i in range(4)]
    seqs = []
    for _step in range(50):
        for i, p in enumerate(progs):
            seqs.append(q.push(p, gate=0x300 + i if i else 0))  # the first layer has no gate
    q.drain()
    assert seqs == list(range(1, 201))
    expected = []
    for _step in range(50):
        for i in range(4):
            if i:
                expected.append((1, 0x1000, 0x300 + i))
            expected += [(3, 0x100 + i, 0x1000), (4, 0x200 + i, 0x1000)]
    assert calls(recorder) == expected
    assert q.issued == q.pushed == 200
    assert q.stop()


def test_wait_issued_waits_for_a_slow_thread(recorder):
    q = fresh(recorder, slow_us=2000.0)
    p = layer_program(1)
    seq = q.push(p, gate=0x301)
    assert q.issued < seq  # 3 calls of 2 ms each have not run yet
    q.wait_issued(seq)
    assert q.issued >= seq and q.waits == 1
    assert len(calls(recorder)) == 3
    assert q.stop()


def test_a_failed_call_stops_the_queue_and_names_the_program(recorder):
    q = fresh(recorder, fail_at=4)  # the second push's launch (calls: wait, launch, record, wait, LAUNCH)
    a, b = layer_program(1), layer_program(2)
    q.name_program(b, "layer 2: gather of 64 B into slot B")
    s1 = q.push(a, gate=0x301)
    s2 = q.push(b, gate=0x302)
    s3 = q.push(a, gate=0x303)
    with pytest.raises(it.IssueThreadError, match=r"layer 2: gather of 64 B.*driver call 1 of push 2 failed "
                                                  r"with CUresult 700; the pushes after it were not run"):
        q.wait_issued(s3)
    assert len(calls(recorder)) == 5  # the third push was skipped: nothing after the failure ran
    assert q.issued == s3 and s1 < s2 < s3
    with pytest.raises(it.IssueThreadError):  # every later check raises it too, for whichever layer
        q.wait_issued(s1)
    assert q.stop()


def test_the_pusher_does_not_wait_for_the_thread(recorder):
    """The hot path's promise: a push returns while the thread is still busy with earlier pushes."""
    q = fresh(recorder, slow_us=20000.0)
    p = layer_program(1)
    seqs = [q.push(p, gate=0x301) for _ in range(3)]
    assert q.issued < seqs[0] or q.issued < seqs[-1]  # 9 calls x 20 ms: far from done when push returns
    q.drain()
    assert q.issued == seqs[-1]
    assert q.stop()


def test_stop_drops_what_was_not_run_and_wait_then_raises(recorder):
    q = fresh(recorder, slow_us=20000.0)
    p = layer_program(1)
    seqs = [q.push(p) for _ in range(10)]
    assert q.stop(timeout_s=5.0)
    assert len(calls(recorder)) < 30  # not every push ran
    with pytest.raises(it.IssueThreadError, match="was stopped"):
        q.push(p)
    assert seqs[-1] == 10


def test_many_pushes_from_one_thread_while_another_reads(recorder):
    """More pushes than the ring holds (1024): the pusher waits for room, nothing is lost or reordered."""
    q = fresh(recorder)
    progs = [layer_program(i) for i in range(8)]
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(q.issued for _ in range(1000)))
    reader.start()
    for n in range(5000):
        q.push(progs[n % 8], gate=0x300 + n % 8)
    reader.join()
    q.drain()
    log = calls(recorder)
    assert len(log) == 15000
    assert [c[1] for c in log[1::3]] == [0x100 + n % 8 for n in range(5000)]
    assert seen == sorted(seen)
    assert q.stop()


def test_a_program_holds_one_to_eight_known_calls():
    with pytest.raises(ValueError, match="1 to 8"):
        it.IssueThread.program([])
    with pytest.raises(ValueError, match="unknown op kind"):
        it.IssueThread.program([(9, 0, 0)])


def test_no_compiler_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(it.IssueThreadUnavailable, match="no-such-cc.*could not be run.*set \\$CC"):
        it.build_library(out_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half-built file left behind


# ---- the communicator's plug-in (wsharding/accel/nccl/issuing.py), on a prepared gather -------------
class _Stub:
    """A driver, a graph or an event: whatever a prepared gather calls on it, recorded."""

    def __init__(self, log: list, exec_handle: int = 0, cuda_event: int = 0) -> None:
        self.log, self.exec_handle, self.cuda_event = log, exec_handle, cuda_event

    def __getattr__(self, name):
        return lambda *a: self.log.append((name, *a))


def _gather_with_plugin(recorder, monkeypatch, rec_thread):
    """A bare communicator (no GPU) whose issue thread is ``rec_thread``, and a prepared gather on it
    that copies its own chunk (graph 0xC0 on stream K=1) and gathers (graph 0xA0 on stream G=2)."""
    import torch

    from wsharding.accel.nccl.communicator import NcclCommunicator
    from wsharding.accel.nccl.gather import NcclPreparedGather
    from wsharding.accel.nccl.watchdog import Watchdog

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    c = object.__new__(NcclCommunicator)
    c.handle, c.aborted, c.closed, c.rank, c.world_size, c.mode = 0x1234, False, False, 0, 2, "gpu-nccl"
    c.timeout_s, c.lock, c.gathers_issued, c.abort_wait_s = 5.0, threading.RLock(), 0, 2.0
    c.watchdog = Watchdog(lambda: None, lambda m: None, timeout_s=5.0, period_s=3600)
    c.issuer = rec_thread  # plugs the thread in, as tests and set_issue_thread(True) do
    here: list = []  # what the calling thread issues itself
    g = object.__new__(NcclPreparedGather)
    g.comm, g.what, g.nbytes, g.in_place, g._peers_only, g._with_peers = c, "layer 5: gather", 4096, False, False, True
    g._copy_stream, g._gather_stream, g._copied_ev, g._ready_ev, g._cu = 1, 2, 0xE1, 0xE2, _Stub(here)
    g.copied = g.ready = _Stub(here, cuda_event=0xE2)
    g._graph = g._launch_graph = _Stub(here, exec_handle=0xA0)
    g._copy_graph = g._launch_copy_graph = _Stub(here, exec_handle=0xC0)
    g.program = g.program_for = g.seq_for = None
    g.seq = 0
    return c, g, here


def test_the_plugin_hands_a_start_to_the_thread_which_issues_what_the_caller_would(recorder, monkeypatch):
    q = fresh(recorder)
    c, g, here = _gather_with_plugin(recorder, monkeypatch, q)
    try:
        g.start(_Stub([], cuda_event=0x3A))
        assert q.pushes == 1 and c.gathers_issued == 1 and g.seq == 1 and here == []  # handed over
        g.wait(_Stub([], cuda_event=0))  # first waits until the thread ran the push
        assert g.seq == 0 and c.watchdog.pending() == 1 and len(here) == 1  # then the stream's wait on ready
        here.clear()
        assert calls(recorder) == [(1, 1, 0x3A), (3, 0xC0, 1), (4, 0xE1, 1), (1, 2, 0xE1), (3, 0xA0, 2),
                                   (4, 0xE2, 2)]
        # trace marks: issued on the calling thread, after what was handed over (the drain), in the same order
        marks = (_Stub([], cuda_event=0x4A), _Stub([], cuda_event=0x4B))
        g.start(_Stub([], cuda_event=0x3B), marks)
        assert q.pushes == 1 and c.gathers_issued == 2
        assert [h[0] for h in here] == ["stream_wait_event", "event_record", "launch", "event_record",
                                        "stream_wait_event", "launch", "event_record", "event_record"]
        c.set_issue_thread(False)  # runs what is left, then stops
        assert c.issuing is None and c.issuer is None and q.closed
    finally:
        c.watchdog.stop()
