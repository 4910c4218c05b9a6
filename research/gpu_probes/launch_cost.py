"""Why do the sharded forward's own kernels cost the host more than the replicated forward's?

host_overhead_profile.py found torch's linear, rms_norm and friends several microseconds slower per
call in the sharded llama8b-blocks forward than in the replicated one (world size 1, one H200). This
probe times the host side of one block's seven linears (decode size, bf16) under conditions that
differ between the two forwards, each in pairs against the plain case:

  param      weights are nn.Parameters (the replicated model)
  view       weights are views into one uint8 buffer (a slot), reinterpreted as bf16
  waited     the compute stream waits, before the linears, on an event recorded on another stream
             behind a long sleep (a gather not yet done)
  copying    a 218 MB device-to-device copy runs on another stream meanwhile
  threadN    the issue thread (wsharding/accel/issue_thread.py) launches N captured graphs of a 218 MB
             copy on another stream while this thread launches the linears: does the driver let two
             threads launch at once, or do this thread's launches wait for the other's?
  smallN     the same with graphs of a 1 MB copy
Run: PYTHONPATH=. python3 research/gpu_probes/launch_cost.py ; writes $OUT/launch_cost.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (2 * 14336, 4096), (4096, 14336)]
params = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=torch.bfloat16) * 0.01, requires_grad=False)
          for s in shapes]
total = sum(p.numel() * 2 for p in params)
slot = torch.empty(total, dtype=torch.uint8, device=dev)
views, off = [], 0
for p in params:
    n = p.numel() * 2
    v = slot[off:off + n].view(torch.bfloat16).view(p.shape)
    v.copy_(p)
    views.append(v)
    off += n
x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
xi = torch.randn(1, 14336, device=dev, dtype=torch.bfloat16)
side = torch.cuda.Stream()
big_a = torch.empty(218 * 2**20, dtype=torch.uint8, device=dev)
big_b = torch.empty_like(big_a)
ev = torch.cuda.Event()


def linears(ws):
    for w in ws[:5]:
        torch.nn.functional.linear(x, w)
    torch.nn.functional.linear(xi, ws[5])
    torch.nn.functional.linear(x, ws[0])


from wsharding.accel.captured_launch import CapturedLaunch  # noqa: E402
from wsharding.accel.cuda_driver import driver  # noqa: E402
from wsharding.accel.issue_thread import OP_LAUNCH, IssueThread, driver_issue_thread  # noqa: E402

cu = driver()
small_a = torch.empty(2**20, dtype=torch.uint8, device=dev)
small_b = torch.empty_like(small_a)
graphs = {
    "big": CapturedLaunch(side.cuda_stream, lambda st: cu.memcpy_dtod_async(big_b.data_ptr(), big_a.data_ptr(),
                                                                              big_a.numel(), st), "218 MB copy"),
    "small": CapturedLaunch(side.cuda_stream, lambda st: cu.memcpy_dtod_async(small_b.data_ptr(), small_a.data_ptr(),
                                                                                small_a.numel(), st), "1 MB copy"),
}
issuer = driver_issue_thread("launch-cost probe", spin_us=2000.0)
programs = {k: IssueThread.program([(OP_LAUNCH, g._handle, side.cuda_stream)]) for k, g in graphs.items()}


def case(name):
    for kind in ("big", "small"):
        for prefix in ("thread", "inline"):
            if name.startswith(prefix) and name[len(prefix):].startswith(kind):
                n = int(name[len(prefix) + len(kind):])

                def f(kind=kind, n=n, prefix=prefix):
                    if prefix == "thread":
                        for _ in range(n):
                            issuer.push(programs[kind])
                        t0 = time.perf_counter()
                        linears(params)
                        dt = time.perf_counter() - t0
                        issuer.drain()
                        return dt
                    t0 = time.perf_counter()
                    for _ in range(n):
                        graphs[kind].launch(side.cuda_stream)
                    linears(params)
                    return time.perf_counter() - t0
                return f
    if name == "param":
        return lambda: linears(params)
    if name == "view":
        return lambda: linears(views)
    if name == "waited":
        def f():
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)
                ev.record(side)
            torch.cuda.current_stream().wait_event(ev)
            t0 = time.perf_counter()
            linears(params)
            return time.perf_counter() - t0
        return f
    if name == "copying":
        def f():
            with torch.cuda.stream(side):
                big_b.copy_(big_a)
            t0 = time.perf_counter()
            linears(params)
            return time.perf_counter() - t0
        return f
    raise ValueError(name)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    inner = fn()
    dt = time.perf_counter() - t0
    return inner if isinstance(inner, float) else dt


out = {}
with torch.no_grad():
    names = ("view", "waited", "copying", "threadbig8", "threadsmall8", "inlinebig8", "inlinesmall8")
    for name in ("param",) + names:
        for _ in range(5):
            timed(case(name))
    for name in names:
        diffs, a_s, b_s = [], [], []
        for k in range(300):
            order = (("param", "other"), ("other", "param"))[k % 2]
            took = {}
            for which in order:
                took[which] = timed(case("param" if which == "param" else name))
            diffs.append((took["other"] - took["param"]) * 1e6)
            a_s.append(took["param"] * 1e6)
            b_s.append(took["other"] * 1e6)
        q1, med, q3 = statistics.quantiles(diffs, n=4)
        out[name] = {"param_us": statistics.median(a_s), f"{name}_us": statistics.median(b_s),
                     "diff_us_median": med, "diff_us_q1": q1, "diff_us_q3": q3}
        print(name, json.dumps(out[name]))
torch.cuda.synchronize()
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "launch_cost.json"), "w") as f:
        json.dump(out, f, indent=1)
