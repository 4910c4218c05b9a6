"""Where the host time of a sharded layer goes: the planner's Python, the gather's driver calls, NCCL.

    torchrun --nproc-per-node N research/gpu_probes/host_breakdown.py [MODEL]   # JSON on rank 0

N ranks on N GPUs, or on one GPU (NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1; the host path is the
same, only the GPU is shared). The bare planner loop of ``bench step`` (launch and wait sequence, no
layer compute), microseconds per sharded layer, median of rounds, with:
  * ``graph``: every gather launched as its captured graph ([Note: a gather launched as a graph]);
  * ``direct``: every gather calling ncclAllGather;
  * ``planner_only``: the gathers' start and wait replaced by functions that do nothing -- what the
    planner's own Python costs;
and single calls, host microseconds each: one gather's start + wait with each launch, and the bare
ctypes calls it is made of.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import torch
import torch.distributed as dist
from probe_report import finish, nccl_rank

from wsharding.core.runner import shard_blocks
from wsharding.lab.bench.step import planner_host_us
from wsharding.models.blocks import BLOCK_TARGETS, build_blocks

ROUNDS = 7


def per_call_us(fn, n: int = 200) -> float:
    """Host time of cheap calls that queue no GPU work: ``n`` back to back, per call."""
    samples = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def per_launch_us(fn, n: int = 40) -> float:
    """Host time of calls that queue GPU work (a gather): each call timed alone, the GPU drained
    between calls (outside the timing), so a full launch queue never counts."""
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty", 6: "event wait",
              7: "event record", 8: "semaphore signal", 9: "semaphore wait", 10: "mem alloc", 11: "mem free",
              12: "batch mem op", 13: "conditional"}


def graph_nodes(launch) -> dict[str, int]:
    """The node types of a captured gather's graph, counted."""
    lib = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_size_t(0)
    assert lib.cuGraphGetNodes(launch._graph, None, ctypes.byref(count)) == 0
    nodes = (ctypes.c_void_p * count.value)()
    assert lib.cuGraphGetNodes(launch._graph, nodes, ctypes.byref(count)) == 0
    kinds: dict[str, int] = {}
    for node in nodes:
        t = ctypes.c_int(-1)
        assert lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)) == 0
        name = NODE_TYPES.get(t.value, str(t.value))
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def loop_us(ws) -> float:
    return statistics.median(planner_host_us(ws, iters=20) for _ in range(ROUNDS))


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "llama8b-blocks"
    rank, world, gpus, dev, comm = nccl_rank()
    net = build_blocks(model, dev)
    ws = shard_blocks(net, "layers", BLOCK_TARGETS, comm)
    with torch.no_grad():
        net(net.inputs(1, rank, dev))
    torch.cuda.synchronize()
    gathers = list(ws.planner.gathers.values())
    out: dict = {"model": model, "world_size": world, "gpus": gpus, "mode": comm.mode, "emulation": comm.emulation,
                 "nccl": comm.library.describe(), "sharded_layers": len(gathers),
                 "in_place": sorted({g.in_place for g in gathers}), "launch": sorted({g.launch for g in gathers})}

    def set_launch(how: str) -> None:
        for g in gathers:
            g.launch = how

    loops: dict[str, list[float]] = {}
    graphs = "graph" in out["launch"]
    for how in ("graph", "direct") * 3 if graphs else ("direct",):  # alternating: drift hits both
        set_launch(how)
        dist.barrier()
        loops.setdefault(how, []).append(loop_us(ws))
    # the planner alone: no gather reaches the driver (nothing is gathered; the loop only times the host)
    for g in gathers:
        g.start = lambda gate=None, marks=None: None
        g.wait = lambda stream=None: None
    loops["planner_only"] = [loop_us(ws)]
    for g in gathers:
        del g.start, g.wait  # the class's methods again
    out["bare_loop_us_per_layer"] = {k: statistics.median(v) for k, v in loops.items()}
    out["bare_loop_samples"] = loops

    g0 = gathers[0]
    compute = torch.cuda.current_stream()
    calls: dict[str, float] = {}
    for how in ("graph", "direct") if graphs else ("direct",):
        g0.launch = how
        calls[f"gather start+wait ({how})"] = per_launch_us(lambda: (g0.start(), g0.wait(compute)))
    if g0._copy_graph is not None:
        copy = g0._copy_graph
        calls["own chunk copy graph launch alone"] = per_launch_us(lambda: copy.launch(g0._copy_stream))
        calls["cuMemcpyDtoDAsync of the own chunk alone"] = per_launch_us(lambda: g0._copy_own_chunk(g0._copy_stream))
    if world > 1:
        g0.launch = "graph"
        graph = g0._graph
        calls["cuGraphLaunch alone"] = per_launch_us(lambda: graph.launch(g0._gather_stream))
        calls["ncclAllGather alone"] = per_launch_us(lambda: g0._nccl_gather(g0._gather_stream))
        out["graph_nodes"] = graph_nodes(graph)
    cu = g0._cu
    ev, s = g0._ready_ev, g0._gather_stream
    calls["cuEventRecord"] = per_call_us(lambda: cu.event_record(ev, s))
    calls["cuStreamWaitEvent"] = per_call_us(lambda: cu.stream_wait_event(s, ev))
    calls["torch.cuda.is_current_stream_capturing"] = per_call_us(torch.cuda.is_current_stream_capturing)
    calls["Stream.cuda_stream"] = per_call_us(lambda: compute.cuda_stream)
    calls["watchdog.watch"] = per_call_us(lambda: comm.watchdog.watch(g0.ready, g0.what))
    out["calls_us"] = calls
    finish(f"host_breakdown_{world}ranks_{gpus}gpu.json", out, ws, comm)


if __name__ == "__main__":
    main()
