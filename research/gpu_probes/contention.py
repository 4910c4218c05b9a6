"""Where a sharded step's extra time goes at prefill sizes: the first layer's gather (nothing before
it to hide behind) or compute slowed by the gathers that run beside it.

    torchrun --nproc-per-node 2 research/gpu_probes/contention.py [TOKENS [mapped] [next] [clocks]]   # rank 0 prints JSON

The llama8b-blocks model, replicated and sharded over both GPUs with our NCCL communicator, under
torch's profiler: per step, the time of the kernels on the compute stream (the same kernels in both
models), the time from the step's start to its first kernel, and the copies of the gathers. Writes
``$OUT/contention_probe.json`` when ``OUT`` is set. ``mapped``: the sharding maps each layer's own
chunk (``map_own_chunk``, NCCL >= 2.30: no own-chunk copy); ``next``: the planner issues the next
step's first gather during the last layer (the ``NextStepPrefetch`` plug-in). With both, what is left of the
sharded step's extra time is compute slowed beside the peer copies. ``clocks``: also time each model
for 2 s without the profiler while ``nvidia-smi`` samples this GPU's SM clock and power every 50 ms --
whether that slowdown comes with lower clocks.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from probe_report import report
from torch.profiler import ProfilerActivity, profile

from wsharding.accel.nccl.communicator import NcclCommunicator
from wsharding.core.next_step import NextStepPrefetch
from wsharding.core.runner import shard_blocks
from wsharding.models.blocks import BLOCK_TARGETS, build_blocks

STEPS = 10


def profiled(fn, steps: int) -> dict:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
    kernels: dict[str, float] = defaultdict(float)
    copies = 0.0
    compute = 0.0
    for e in prof.events():
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        name = e.name
        if "memcpy" in name.lower() or "memset" in name.lower():
            copies += us
        elif e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[name[:60]] += us
            compute += us
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    return {"timeline": gaps(prof, steps),"step_ms": start.elapsed_time(end) / steps, "kernel_ms_per_step": compute / steps / 1e3,
            "copy_ms_per_step": copies / steps / 1e3,
            "top_kernels_ms_per_step": {k: v / steps / 1e3 for k, v in top}}


def gaps(prof, steps: int) -> dict:
    """Idle stretches of the compute stream (the stream with the most kernel time) longer than 20 us,
    each with the copy that ended last before the stretch ended: the compute stream waiting for a
    gather ends right after that gather's last copy."""
    evs = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        evs.append((e.device_resource_id(), e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3, e.name()))
    busy: dict[int, float] = defaultdict(float)
    for stream, t0, t1, name in evs:
        if "memcpy" not in name.lower():
            busy[stream] += t1 - t0
    compute = max(busy, key=busy.get)
    kern = sorted((t0, t1, name) for st, t0, t1, name in evs if st == compute)
    copies = sorted((t1, t0, st, name) for st, t0, t1, name in evs if "memcpy" in name.lower())
    out, total = [], 0.0
    for (_a0, a1, _), (b0, _b1, bname) in zip(kern, kern[1:], strict=False):
        gap = b0 - a1
        if gap <= 20:
            continue
        total += gap
        before = [c for c in copies if c[0] <= b0 + 5]
        last = before[-1] if before else None
        out.append({"at_us": round(a1 - kern[0][0], 1), "gap_us": round(gap, 1), "next": bname[:40],
                    "copy_ended_us_before": None if last is None else round(b0 - last[0], 1),
                    "copy": None if last is None else f"{last[3][:30]} on stream {last[2]}, {last[0] - last[1]:.0f} us"})
    first_step = [c for c in copies if c[1] - kern[0][0] < (kern[-1][1] - kern[0][0]) / steps]
    return {"compute_stream": compute, "idle_us_per_step": total / steps, "gaps_first_steps": out[:40],
            "copies_first_step": [{"start_us": round(t0 - kern[0][0], 1), "end_us": round(t1 - kern[0][0], 1),
                                   "stream": st, "name": n[:30]} for t1, t0, st, n in first_step][:40]}


def clocked(fn, device_index: int, seconds: float = 2.0) -> dict:
    """Run ``fn`` for ``seconds`` (no profiler) while nvidia-smi samples the GPU's SM clock (MHz)
    and power (W) every 50 ms; medians and the sample count."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-i", str(device_index), "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        steps += 1
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 1]
    sm = [float(a) for a, _ in rows]
    watts = [float(b) for _, b in rows]
    return {"step_ms": elapsed / steps * 1e3, "samples": len(rows),
            "sm_mhz_median": statistics.median(sm) if sm else None,
            "power_w_median": statistics.median(watts) if watts else None}


def main() -> None:
    rank = int(os.environ["RANK"])
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    flags = set(sys.argv[2:])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    comm = NcclCommunicator(None, device=dev)
    replicated = build_blocks("llama8b-blocks", dev)
    sharded = build_blocks("llama8b-blocks", dev)
    ws = shard_blocks(sharded, "layers", BLOCK_TARGETS, comm, map_own_chunk="mapped" in flags,
                      plugins=[NextStepPrefetch()] if "next" in flags else ())
    x = replicated.inputs(tokens, 1000 + rank, dev)
    result = {"tokens_per_rank": tokens, "map_own_chunk": "mapped" in flags, "prefetch_next_step": "next" in flags}
    with torch.no_grad():
        result["equal"] = bool(torch.equal(replicated(x), sharded(x)))
        for name, fn in (("replicated", lambda: replicated(x)), ("sharded", lambda: sharded(x)),
                         ("replicated_again", lambda: replicated(x))):
            dist.barrier()
            result[name] = profiled(fn, STEPS)
        if "clocks" in flags:
            for name, fn in (("replicated", lambda: replicated(x)), ("sharded", lambda: sharded(x))):
                dist.barrier()
                result[f"{name}_clocks"] = clocked(fn, rank)
    ws.close()
    comm.close()
    if rank == 0:
        report("contention_probe.json", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
