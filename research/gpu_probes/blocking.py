"""Host cost of one ncclAllGather (copy engine, symmetric window, in place) on a blocking and on a
non-blocking NCCL communicator, side by side in one run.

    torchrun --nproc-per-node 2 research/gpu_probes/blocking.py     # two GPUs; rank 0 prints JSON

Why: a non-blocking communicator runs each collective on a thread NCCL starts for that call
([Note: blocking communicator] in wsharding/accel/nccl/communicator.py). Writes
``$OUT/blocking_probe.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from probe_report import report

from wsharding.accel.nccl.communicator import NcclCommunicator

CALLS, REPEATS = 200, 5


def time_calls(blocking: bool, rank: int) -> dict[str, float]:
    c = NcclCommunicator(None, device=torch.device("cuda", rank), blocking=blocking)
    full = c.alloc(2 << 20, tag="full")
    c.register_all()
    n = full.numel() // c.world_size
    g = c.prepare_gather(full, full.narrow(0, c.rank * n, n))
    for _ in range(20):
        g.start()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            g.start()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
        dist.barrier()
    c.close()
    return {"us_per_gather_min": min(times), "us_per_gather_median": sorted(times)[REPEATS // 2],
            "in_progress_launches": g.in_progress_launches}


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo")
    result: dict[str, list] = {}
    for blocking in (False, True, False, True):
        result.setdefault("blocking" if blocking else "nonblocking", []).append(time_calls(blocking, rank))
    if rank == 0:
        report("blocking_probe.json", result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
