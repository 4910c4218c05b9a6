"""Rank tasks that check the hot path on GPUs: the host never waits for the GPU, and a rank that
goes missing in the middle of a forward ends in an error (the watchdog), never a hang."""

from __future__ import annotations

import time
from typing import Any

import torch

from wsharding.cluster import RankContext
from wsharding.comm.base import CommError
from wsharding.lab.tasks.model import shard_comm_for
from wsharding.models import build_pair, decoder_config
from wsharding.models.blocks import BLOCK_TARGETS, build_blocks
from wsharding.shard import shard_blocks

#: About a second of GPU time on an H200 (torch.cuda._sleep spins this many cycles).
LONG_SLEEP_CYCLES = 2_000_000_000


def host_not_held(ctx: RankContext, comm: str, lookahead: bool, model: str = "small") -> dict[str, Any]:
    """Queue a long GPU sleep on the compute stream, run a sharded forward, and report whether the
    forward returned to Python while the sleep was still running (it must: the hot path never waits
    for the GPU). ``model``: a ToyDecoder preset, or ``tiny-blocks`` for the generic hook path."""
    c = shard_comm_for(ctx, comm)
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


def missing_rank(ctx: RankContext, timeout_s: float = 5.0) -> dict[str, Any]:
    """Rank 1 skips a step; rank 0 runs it and then waits for the GPU. With our NCCL communicator's
    watchdog, rank 0 gets an error naming the layer and rank within about ``timeout_s`` instead of
    hanging; rank 1 reports what it saw. Ranks share one GPU (NCCL >= 2.30) or have one each."""
    from wsharding.comm.nccl import from_context

    c = from_context(ctx, timeout_s=timeout_s)
    _, net = build_pair(decoder_config("tiny"), c)
    dev = c.device
    x = torch.arange(3, device=dev)
    out: dict[str, Any] = {"rank": ctx.rank}
    with torch.no_grad():
        net(x)
        torch.cuda.synchronize(dev)
        c.barrier()
        t0 = time.perf_counter()
        try:
            if ctx.rank == 0:
                net(x)  # rank 1 never joins these gathers
                torch.cuda.synchronize(dev)  # blocks until the watchdog aborts the stuck gather
                net(x)  # the next planner call raises the watchdog's error
            else:
                time.sleep(3 * timeout_s)
            out["error"] = None
        except CommError as e:
            out["error"] = str(e)
        except RuntimeError as e:  # a CUDA error surfacing from the aborted stream
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.perf_counter() - t0
    return out
