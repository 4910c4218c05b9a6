"""Does an event-wait node of a graph wait for the event's record made before each *launch*?

    python3 research/gpu_probes/graph_event_wait.py     # one GPU; JSON to $OUT

A layer's gather waits for its gate (an event the compute stream records after the slot's last
reader) and records its ready event: two driver calls around each launch. Inside the graph -- a wait
captured with CU_EVENT_WAIT_EXTERNAL, a record with CU_EVENT_RECORD_EXTERNAL -- they would cost the
launch two nodes instead. That is only right if the wait node waits for the record made before each
launch, not the one the event had at capture. Checked: the gate recorded behind a ~0.2 s sleep on
another stream, three launches, each must leave its write undone until the sleep ends; host
microseconds of the launch with the two nodes against the launch plus the two calls.
"""
from __future__ import annotations

import ctypes
import json
import os
import statistics
import time

import torch

from wsharding.accel.captured_launch import CapturedLaunch
from wsharding.accel.cuda_driver import driver

lib = ctypes.CDLL("libcuda.so.1")
record_flags = lib.cuEventRecordWithFlags
record_flags.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
write_value = lib.cuStreamWriteValue32_v2
write_value.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
WAIT_EXTERNAL, RECORD_EXTERNAL = 1, 1
cu = driver()
dev = torch.device("cuda", 0)
C, G = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
gate, ready = torch.cuda.Event(), torch.cuda.Event()
gate.record(C)
ready.record(G)
x = torch.zeros(1, dtype=torch.int32, device=dev)
a = torch.arange(1 << 22, dtype=torch.int32, device=dev)
b = torch.zeros_like(a)
torch.cuda.synchronize()


def fused(s: int) -> None:
    assert cu._cuStreamWaitEvent(s, gate.cuda_event, WAIT_EXTERNAL) == 0
    cu.memcpy_dtod_async(b.data_ptr(), a.data_ptr(), a.numel() * 4, s)
    assert write_value(s, x.data_ptr(), 1, 0) == 0
    assert record_flags(ready.cuda_event, s, RECORD_EXTERNAL) == 0


def plain(s: int) -> None:
    cu.memcpy_dtod_async(b.data_ptr(), a.data_ptr(), a.numel() * 4, s)


g_fused = CapturedLaunch(G.cuda_stream, fused, "fused")
g_plain = CapturedLaunch(G.cuda_stream, plain, "plain")
out: dict = {"launches": []}
for _ in range(3):
    x.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(C):
        torch.cuda._sleep(400_000_000)
    gate.record(C)
    g_fused.launch(G.cuda_stream)
    time.sleep(0.02)
    held = not ready.query()  # no host read of x: that would wait for the GPU
    torch.cuda.synchronize()
    out["launches"].append({"held_until_gate": held, "written_after": int(x.item()) == 1, "ready_done": ready.query()})
print(out, flush=True)


def timed(fn, n=60):
    s = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        s.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(s)


out["host_us"] = {}
for _ in range(3):  # alternating: the host drifts
    out["host_us"].setdefault("launch with the wait and record nodes", []).append(
        timed(lambda: g_fused.launch(G.cuda_stream)))
    out["host_us"].setdefault("wait call + launch + record call", []).append(timed(lambda: (
        cu.stream_wait_event(G.cuda_stream, gate.cuda_event), g_plain.launch(G.cuda_stream),
        cu.event_record(ready.cuda_event, G.cuda_stream))))
print(json.dumps(out["host_us"]), flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "graph_event_wait_h200.json"), "w") as f:
        json.dump(out, f, indent=1)
