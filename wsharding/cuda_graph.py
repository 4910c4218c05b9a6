"""Capture a decode step -- gathers, gate and ready events, layer compute -- in one CUDA graph.

Why a helper: a capture must not be the first run of anything. cuBLAS creates its handle and
workspace on first use, and the planner prepares its gathers at the first step; both allocate and
call the host, which a capture refuses. So the callable runs ``warmup`` times on a side stream first
(the pattern torch's documentation gives for graphs), and the capture uses ``thread_local`` error
mode, because the NCCL communicator's watchdog thread may query events of earlier eager steps while
this thread captures.

Replaying the graph re-runs the recorded launches without Python: the host cost per layer that an
eager step pays (planner, communicator, module hooks) is gone, which is what decode at small batch
needs. Inputs and outputs are static: copy new tokens into the captured input tensor before each
replay, read the returned output after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from wsharding.core.errors import Unsupported


def capture_graph(fn: Callable[[], Any], device: torch.device, *, warmup: int = 2,
                  pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn`` up on a side stream, then capture one call of it; returns (graph, static output).

    ``graph.replay()`` runs the captured step again on whatever the captured input tensors hold.
    ``pool``: a memory pool shared with other graphs (``torch.cuda.graph_pool_handle()``), for graphs
    that are replayed one at a time and whose outputs are read before another replays: the graphs of
    a server's step shapes then hold one step's activations between them, not one each.
    """
    if torch.device(device).type != "cuda":
        raise Unsupported(f"capture_graph needs a CUDA device, got {device}: CUDA graphs exist only on GPUs")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out
