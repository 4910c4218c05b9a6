"""Can a step's gathers be one graph, launched at the step's start, gated by flags on the GPU?

    python3 research/gpu_probes/step_graph_semantics.py        # one GPU; JSON to $OUT if set

Checks, each printed with its outcome:
  * a stream that waits (cuStreamWaitEvent, host order) on an event that a graph *launched earlier*
    records in an event-record node waits for that graph's record, not the event's previous one;
  * cuStreamWaitValue32 / cuStreamWriteValue32 can be captured into a graph; a graph node that waits
    for a flag runs only after another stream writes the flag, and resets it;
  * a graph stuck on a flag is released by a write from a third stream;
  * host microseconds of cuStreamWriteValue32, cuStreamWaitEvent and cuGraphLaunch of graphs of 1
    and 8 such copies.
"""
from __future__ import annotations

import ctypes
import json
import os
import statistics
import time

import torch

from wsharding.accel.captured_launch import CU_STREAM_CAPTURE_MODE_RELAXED
from wsharding.accel.cuda_driver import CUgraph, CUgraphExec, driver

cu = driver()
lib = ctypes.CDLL("libcuda.so.1")
names = {}
for base in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
    for suffix in ("_v2", ""):
        if hasattr(lib, base + suffix):
            names[base] = base + suffix
            break
wait_value = getattr(lib, names["cuStreamWaitValue32"])
wait_value.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
write_value = getattr(lib, names["cuStreamWriteValue32"])
write_value.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
record_flags = lib.cuEventRecordWithFlags
record_flags.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
EXTERNAL = 1  # CU_EVENT_RECORD_EXTERNAL
out = {"symbols": names}


def check(rc, what):
    if rc:
        raise RuntimeError(f"{what}: CUresult {rc}")


def capture(stream, record):
    g, e = CUgraph(), CUgraphExec()
    check(cu._cuStreamBeginCapture_v2(stream.cuda_stream, CU_STREAM_CAPTURE_MODE_RELAXED), "begin")
    try:
        record(stream.cuda_stream)
    finally:
        rc = cu._cuStreamEndCapture(stream.cuda_stream, ctypes.byref(g))
    check(rc, "end")
    check(cu._cuGraphInstantiateWithFlags(ctypes.byref(e), g, 0), "instantiate")
    return e


dev = torch.device("cuda", 0)
G, C, R = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
x = torch.zeros(1, dtype=torch.int32, device=dev)
y = torch.zeros(1, dtype=torch.int32, device=dev)
ev = torch.cuda.Event()
ev.record(G)
torch.cuda.synchronize()

# 1. graph record node seen by a later host-ordered wait
def rec1(s):
    with torch.cuda.stream(G):
        torch.cuda._sleep(200_000_000)  # ~0.1-0.2 s
    check(write_value(s, x.data_ptr(), 1, 0), "write")
    check(record_flags(ev.cuda_event, s, EXTERNAL), "record ext")


g1 = capture(G, rec1)
check(cu._cuGraphLaunch(g1, G.cuda_stream), "launch")
cu.stream_wait_event(C.cuda_stream, ev.cuda_event)
with torch.cuda.stream(C):
    y.copy_(x)
torch.cuda.synchronize()
out["wait_sees_graph_record"] = int(y.item()) == 1
print("1. later wait sees the graph's record:", out["wait_sees_graph_record"], flush=True)

# 2. flag-gated copy in a graph
flag = torch.zeros(1, dtype=torch.int32, device=dev)
a = torch.arange(1 << 20, dtype=torch.int32, device=dev)
b = torch.zeros_like(a)
done = torch.cuda.Event()
done.record(G)


def rec2(s):
    check(wait_value(s, flag.data_ptr(), 1, EQ), "wait value")
    check(write_value(s, flag.data_ptr(), 0, 0), "reset")
    cu.memcpy_dtod_async(b.data_ptr(), a.data_ptr(), a.numel() * 4, s)
    check(record_flags(done.cuda_event, s, EXTERNAL), "record ext")


torch.cuda.synchronize()
g2 = capture(G, rec2)
torch.cuda.synchronize()
out["flag_graph_ok"] = []
for _ in range(3):
    b.zero_()
    torch.cuda.synchronize()
    check(cu._cuGraphLaunch(g2, G.cuda_stream), "launch")
    with torch.cuda.stream(C):
        torch.cuda._sleep(100_000_000)
    time.sleep(0.01)
    not_yet = not done.query()
    check(write_value(C.cuda_stream, flag.data_ptr(), 1, 0), "write on C")
    cu.stream_wait_event(C.cuda_stream, done.cuda_event)
    with torch.cuda.stream(C):
        ok = torch.equal(b, a)
    torch.cuda.synchronize()
    out["flag_graph_ok"].append({"held_before_flag": not_yet, "copied": bool(ok), "flag_reset": int(flag.item()) == 0})
print("2. flag-gated graph:", out["flag_graph_ok"], flush=True)

# 3. release a stuck graph from a third stream
check(cu._cuGraphLaunch(g2, G.cuda_stream), "launch")
time.sleep(0.05)
stuck = not done.query()
check(write_value(R.cuda_stream, flag.data_ptr(), 1, 0), "release")
t0 = time.monotonic()
while not done.query() and time.monotonic() - t0 < 5:
    time.sleep(0.001)
out["release"] = {"stuck_before": stuck, "released": done.query()}
print("3. release:", out["release"], flush=True)
torch.cuda.synchronize()


# 4. host costs
def per_call(fn, n=400):
    s = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        s.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(s)


flags8 = torch.zeros(8, dtype=torch.int32, device=dev)
readies = [torch.cuda.Event() for _ in range(8)]
for r in readies:
    r.record(G)


def rec8(s, count=8):
    for i in range(count):
        p = flags8.data_ptr() + 4 * i
        check(wait_value(s, p, 1, EQ), "wait")
        check(write_value(s, p, 0, 0), "reset")
        cu.memcpy_dtod_async(b.data_ptr(), a.data_ptr(), 4096, s)
        check(record_flags(readies[i].cuda_event, s, EXTERNAL), "rec")


torch.cuda.synchronize()
g8 = capture(G, rec8)
g1c = capture(G, lambda s: rec8(s, 1))
out["host_us"] = {
    "cuStreamWriteValue32": per_call(lambda: write_value(C.cuda_stream, y.data_ptr(), 0, 0)),
    "cuStreamWaitEvent": per_call(lambda: cu.stream_wait_event(C.cuda_stream, ev.cuda_event)),
    "cuEventRecord": per_call(lambda: cu.event_record(ev.cuda_event, C.cuda_stream)),
}


def launch_and_release(g, n):
    check(cu._cuGraphLaunch(g, G.cuda_stream), "launch")
    for i in range(n):
        write_value(C.cuda_stream, flags8.data_ptr() + 4 * i, 1, 0)


def timed_launch(g, n):
    s = []
    for _ in range(60):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        check(cu._cuGraphLaunch(g, G.cuda_stream), "launch")
        s.append((time.perf_counter() - t0) * 1e6)
        for i in range(n):
            write_value(C.cuda_stream, flags8.data_ptr() + 4 * i, 1, 0)
        torch.cuda.synchronize()
    return statistics.median(s)


out["host_us"]["cuGraphLaunch, 1 gated copy"] = timed_launch(g1c, 1)
out["host_us"]["cuGraphLaunch, 8 gated copies"] = timed_launch(g8, 8)
print("4. host us:", json.dumps(out["host_us"], indent=1), flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "step_graph_semantics_h200.json"), "w") as f:
        json.dump(out, f, indent=1)
