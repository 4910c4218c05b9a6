"""The probes' one way to report: print the JSON, and keep it as ``$OUT/NAME`` when ``OUT`` is set (the
GPU machine returns what a command leaves there). Also the start and end of a torchrun probe rank that
gathers through our NCCL communicator (gloo between the processes, one or several ranks per GPU)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist


def report(name: str, result: Any) -> None:
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=1)


def nccl_rank() -> tuple[int, int, int, torch.device, Any]:
    """(rank, world size, GPUs, this rank's device, our NCCL communicator) of a torchrun rank."""
    from wsharding.accel.nccl import NcclCommunicator

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    dev = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    return rank, world, gpus, dev, NcclCommunicator(None, device=dev)


def finish(name: str, result: Any, ws: Any, comm: Any) -> None:
    """Report ``result`` from rank 0 once every rank is done, then close the sharding and the group."""
    torch.cuda.synchronize()
    dist.barrier()
    if dist.get_rank() == 0:
        report(name, result)
    ws.close()
    comm.close()
    dist.destroy_process_group()
