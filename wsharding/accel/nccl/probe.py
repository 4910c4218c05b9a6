"""Was the copy-engine path taken? Two independent checks.

1. **No kernel** (the direct check): the copy-engine AllGather launches no CUDA kernel -- the data
   moves by copy-engine memcpys. Under ``torch.profiler`` a gather with CTA policy 0 shows an
   ``ncclDevKernel_AllGather...`` kernel; a copy-engine gather shows none. This checks what
   actually ran, so it is the one the tests and the benchmark report.
2. **NCCL's log**: with ``NCCL_DEBUG=INFO`` NCCL writes "Comm config CTA policy flags set to 2"
   when a communicator takes policy zero. That proves the policy was accepted, not that every
   condition of the copy engine held (windows, P2P, cuMem), so it is reported as a second fact.
   It needs ``NCCL_DEBUG=INFO`` (and ideally ``NCCL_DEBUG_FILE``) set before the library's first
   call in the process; :func:`log_environment` gives those variables.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch

from wsharding.core.errors import WshardingError
from wsharding.io_checks import open_regular_file

POLICY_LINE = re.compile(r"CTA policy flags set to (\d+)")


def log_environment(directory: str) -> dict[str, str]:
    """Environment for rank processes so each writes NCCL's INFO log to its own file."""
    return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": os.path.join(directory, "nccl.%h.%p.log")}


def policies_in_log(text: str) -> list[int]:
    """Every CTA policy NCCL reported in a log, in order."""
    return [int(m) for m in POLICY_LINE.findall(text)]


def own_log_text() -> str:
    """This process's NCCL log, when ``NCCL_DEBUG_FILE`` pointed at a per-process file."""
    pattern = os.environ.get("NCCL_DEBUG_FILE", "")
    if not pattern:
        return ""
    path = pattern.replace("%h", os.uname().nodename).replace("%p", str(os.getpid()))
    try:
        # NCCL_DEBUG_FILE may name a FIFO that streams the log elsewhere: reading it would wait for
        # NCCL to close its end ([Note: only regular files] in wsharding.io_checks). The log is ours and
        # may be long, so it is not bounded; only its kind is checked.
        fd = open_regular_file(path, "NCCL_DEBUG_FILE", max_bytes=None, todo="")
        with os.fdopen(fd, errors="replace") as f:
            return f.read()
    except (OSError, WshardingError):
        return ""


def device_activity(fn: Callable[[], Any], device: torch.device) -> dict[str, list[str]]:
    """Names of the kernels and memcpys that ran on the GPU while ``fn()`` ran."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels, copies = [], []
    for ev in prof.events():
        if getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name
        (copies if "memcpy" in name.lower() or "memset" in name.lower() else kernels).append(name)
    return {"kernels": kernels, "copies": copies}


def copy_engine_check(comm: Any, full: torch.Tensor, chunk: torch.Tensor) -> dict[str, Any]:
    """Run one gather under the profiler; ``copy_engine`` is True when no NCCL kernel ran.

    Meaningless at world size 1 (an in-place gather there moves nothing): reported as None.
    """
    act = device_activity(lambda: comm.all_gather_into(full, chunk, async_op=True).synchronize(), comm.device)
    nccl_kernels = [k for k in act["kernels"] if "nccl" in k.lower()]
    ce = None if comm.world_size == 1 else not nccl_kernels
    return {"copy_engine": ce, "nccl_kernels": sorted(set(nccl_kernels)), "copies": len(act["copies"]),
            "copy_names": sorted(set(act["copies"]))[:6], "cta_policy": comm.cta_policy}
