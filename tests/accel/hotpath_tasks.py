"""Rank tasks that check the hot path on GPUs: the host never waits for the GPU, and a rank that
goes missing in the middle of a forward ends in an error (the watchdog), never a hang."""

from __future__ import annotations

import time
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.comm import CommError
from wsharding.core.context import RankContext
from wsharding.core.runner import shard_blocks
from wsharding.models import build_pair, decoder_config
from wsharding.models.blocks import BLOCK_TARGETS, build_blocks

#: About a second of GPU time on an H200 (torch.cuda._sleep spins this many cycles).
LONG_SLEEP_CYCLES = 2_000_000_000


def host_not_held(ctx: RankContext, comm: str, lookahead: bool, model: str = "small",
                  issue_thread: bool = False) -> dict[str, Any]:
    """Queue a long GPU sleep on the compute stream, run a sharded forward, and report whether the
    forward returned to Python while the sleep was still running (it must: the hot path never waits
    for the GPU). ``model``: a ToyDecoder preset, or ``tiny-blocks`` for the generic hook path.
    ``issue_thread``: with our NCCL communicator's issue thread (stopped again at the end)."""
    c = shard_comm_for(ctx, comm)
    if issue_thread:
        c.set_issue_thread(True)
        try:
            return host_not_held(ctx, comm, lookahead, model) | {"issue_thread_pushes": c.issuer.pushes}
        finally:
            c.set_issue_thread(False)
    dev = c.device
    if model.endswith("blocks"):
        net = build_blocks(model, dev)
        ws = shard_blocks(net, "layers", BLOCK_TARGETS, c, lookahead=lookahead)
        x = net.inputs(4, ctx.rank, dev)
    else:
        _, net = build_pair(decoder_config(model), c, lookahead=lookahead)
        ws = net.weight_sharding
        x = torch.arange(4, device=dev)
    with torch.no_grad():
        net(x)  # warm-up: cuBLAS handles, first-call allocations
        torch.cuda.synchronize(dev)
        done = torch.cuda.Event()
        torch.cuda._sleep(LONG_SLEEP_CYCLES)
        done.record()
        t0 = time.perf_counter()
        net(x)
        host_ms = (time.perf_counter() - t0) * 1e3
        still_sleeping = not done.query()
        torch.cuda.synchronize(dev)
    return {"rank": ctx.rank, "mode": c.mode, "returned_while_gpu_busy": still_sleeping, "host_ms": host_ms,
            "gathers": ws.planner.gathers_this_step}


def missing_rank(ctx: RankContext, timeout_s: float = 5.0, blocking: bool = True) -> dict[str, Any]:
    """Rank 1 skips a step; rank 0 runs it and keeps stepping. With our NCCL communicator's watchdog,
    rank 0 gets an error naming the layer and rank within about ``timeout_s`` instead of hanging;
    rank 1 reports what it saw. Ranks share one GPU (NCCL >= 2.30) or have one each.

    Rank 0 steps as a serving loop would, back to back. The copy-engine gather waits on the GPU for a
    flag that the missing peer would write, and ``ncclCommAbort`` does not write it (NCCL 2.28), so
    that stream stays stuck: without the planner's backpressure ([Note: backpressure] in
    ``planner.py``) the host would fill CUDA's launch queue and hang inside a launch. What the user
    gets instead is the error on the host; the process then exits (a stuck stream does not hold the
    exit), and the cluster stops its ranks.
    """
    from wsharding.accel.nccl import from_context

    c = from_context(ctx, timeout_s=timeout_s, blocking=blocking)
    _, net = build_pair(decoder_config("tiny"), c)
    dev = c.device
    x = torch.arange(3, device=dev)
    out: dict[str, Any] = {"rank": ctx.rank, "blocking": c.blocking, "forwards": 0}
    with torch.no_grad():
        net(x)
        torch.cuda.synchronize(dev)
        c.barrier()
        t0 = time.perf_counter()
        try:
            if ctx.rank == 0:
                # rank 1 never joins these gathers; each next step's planner call checks the watchdog
                while time.perf_counter() - t0 < 12 * timeout_s:
                    net(x)
                    out["forwards"] += 1
            else:
                time.sleep(3 * timeout_s)
            out["error"] = None
        except CommError as e:
            out["error"] = str(e)
        out["seconds"] = time.perf_counter() - t0
    return out


def launch_modes_equal(ctx: RankContext, model: str = "small", steps: int = 3) -> dict[str, Any]:
    """[Note: a gather launched as a graph]: run a sharded model with every gather launched as its
    captured graph, then with ``ncclAllGather`` called per layer, both against the replicated model
    bit for bit; report the graphs the communicator holds before and after the sharding closes."""
    c = shard_comm_for(ctx, "nccl")
    replicated, net = build_pair(decoder_config(model), c, map_own_chunk=False)  # plain: every gather copies
    ws = net.weight_sharding
    gathers = list(ws.planner.gathers.values())
    graphs_open = c.describe()["captured_graphs"]
    out: dict[str, Any] = {"rank": ctx.rank, "mode": c.mode, "gather_launch": c.gather_launch,
                           "sharded_layers": len(gathers), "graphs_while_open": graphs_open,
                           "copying_gathers": sum(not g.in_place for g in gathers),
                           "launch": sorted({g.launch for g in gathers})}
    with torch.no_grad():
        for how in ("graph", "direct", "graph"):
            for g in gathers:
                g.launch = how
            equal = []
            for step in range(steps):
                x = torch.arange(3 + step + ctx.rank, device=c.device) % 50
                equal.append(bool(torch.equal(replicated(x), net(x))))
            out.setdefault("equal", []).append((how, equal))
    torch.cuda.synchronize(c.device)
    ws.close()
    out["graphs_after_close"] = c.describe()["captured_graphs"]
    return out


def issue_thread_error(ctx: RankContext) -> dict[str, Any]:
    """[Note: the issue thread]: a driver call that fails on the issue thread reaches the model's
    thread as a :class:`CommError` naming the layer and rank, and aborts the communicator. The failure
    is made by handing the thread ``cuInit`` in place of ``cuStreamWaitEvent``: called with a stream
    handle as its flags it returns CUDA_ERROR_INVALID_VALUE (1), at the first gather that waits for a
    gate. Leaves the communicator aborted: run it in a cluster of its own."""
    import ctypes

    from wsharding.accel.issue_thread import driver_issue_thread, fn_address

    c = shard_comm_for(ctx, "nccl")
    _, net = build_pair(decoder_config("tiny"), c)
    x = torch.arange(3, device=c.device)
    failing_wait = ctypes.CDLL("libcuda.so.1").cuInit
    out: dict[str, Any] = {"rank": ctx.rank, "error": None, "sharded_layers": len(net.weight_sharding.sharded_layer_ids)}
    with torch.no_grad():
        net(x)
        torch.cuda.synchronize(c.device)
        c.set_issue_thread(False)
        c.issuer = driver_issue_thread("an issue thread whose stream waits fail", wait=fn_address(failing_wait))
        try:
            for _ in range(3):
                net(x)
        except CommError as e:
            out["error"] = str(e)
        out["aborted"] = c.aborted
        out["pushes"] = c.issuer.pushes
    return out
