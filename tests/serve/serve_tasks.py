"""Rank tasks of the serving tests: the replicated and the sharded model serve the same requests with
pools of one size -- so they run the same steps -- with the step runner's graphs off and on; and the
sharded model serving, aligned, arrivals that leave every rank idle for a while.

Module level, importable as ``tests.serve.serve_tasks`` (spawned ranks import tasks by module name).
They call the library directly -- no teaching layer, no Jupyter stack -- so the GPU machine runs them
as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from wsharding.comm_by_name import shard_comm_for
from wsharding.models import build_pair, decoder_config
from wsharding.serve import BlockPool, Request, Workload, serve
from wsharding.serve.runner import StepRunner, shapes_of_every_rank
from wsharding.serve.step import context_buckets


def _earliest(ctx, ready_at: float) -> float:
    """When the earliest rank has something to compute (every rank calls it before every step: the ranks
    stay in step); float64, so +inf -- nothing left -- survives the reduction. The lab's own
    (``wsharding.lab.tasks.serve._earliest``) is out of reach: library tests do not import the lab."""
    if ctx.world_size == 1:
        return ready_at
    t = torch.tensor([ready_at], dtype=torch.float64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t.item())


def serve_with_graphs(ctx, preset: str, *, comm: str = "torch", requests: int = 5, blocks: int = 24,
                      token_budget: int = 32, prompt: tuple[int, int] = (6, 70), output: tuple[int, int] = (4, 20),
                      shared_gpu: bool = False) -> dict[str, Any]:
    """Serve this rank's requests (all at once) with each variant, first with every step eager (the
    runner with graphs off records the decode-only shapes it met), then -- every rank having captured
    the union of the shapes any rank met, for both variants -- through graphs where it can.

    Returns each run's tokens and the runner's counts; the emulation, where ranks share a GPU."""
    cfg = decoder_config(preset)
    comm_ = shard_comm_for(ctx, comm)
    replicated, sharded = build_pair(cfg, comm_)
    wl = Workload(requests=requests, prompt=prompt, output=output, seed=3)
    reqs = wl.for_rank(ctx.rank, cfg.vocab)
    max_context = context_buckets(wl.max_len)[-1]
    models = {"replicated": replicated, "sharded": sharded}

    def run(model, runner) -> dict[int, list[int]]:
        pool = runner.pool
        out = serve(model, pool, reqs, token_budget=token_budget, max_context=max_context,
                    agree=lambda ready_at: _earliest(ctx, ready_at), runner=runner)
        return {rid: list(toks) for rid, toks in out.outputs.items()}

    result: dict[str, Any] = {"rank": ctx.rank, "mode": comm_.mode, "emulation": comm_.emulation or ctx.emulation}
    met = []
    for name, model in models.items():
        runner = StepRunner(model, BlockPool.for_model(model, blocks), graphs=False)
        result[f"{name}_eager"] = run(model, runner)
        result[f"{name}_eager_counts"] = runner.counts()
        met += list(runner.missed)
    shapes = shapes_of_every_rank(met)
    result["shapes"] = len(shapes)
    for name, model in models.items():
        runner = StepRunner(model, BlockPool.for_model(model, blocks), shared_gpu=shared_gpu)
        result[f"{name}_captured"] = runner.capture(shapes)
        result[f"{name}_graphs"] = run(model, runner)
        result[f"{name}_graphs_counts"] = runner.counts()
        runner.close()  # before the communicator: NCCL's destroy waits for graphs holding its gathers
    return result


def serve_across_a_gap(ctx, preset: str = "tiny", gap_s: float = 1.0) -> dict[str, Any]:
    """The sharded model serves, aligned, two requests per rank: one at the start (rank 0 generates 2
    tokens, rank 1 5: rank 0 pads 3 steps while rank 1 computes), one at ``gap_s`` (2 tokens each), so
    from rank 1's fifth step to ``gap_s`` no rank has anything to compute. Returns what ran, per step."""
    cfg = decoder_config(preset)
    _, sharded = build_pair(cfg, shard_comm_for(ctx, "torch"))
    prompt = tuple(range(1, 7))
    reqs = [Request(ctx.rank, ctx.rank, 0.0, prompt, 2 if ctx.rank == 0 else 5),
            Request(ctx.world_size + ctx.rank, ctx.rank, gap_s, prompt, 2)]
    run = serve(sharded, BlockPool.for_model(sharded, 8), reqs, token_budget=16, max_context=context_buckets(16)[-1],
                agree=lambda ready_at: _earliest(ctx, ready_at))
    return {"rank": ctx.rank, "step_requests": run.step_requests, "schedule_times": run.schedule_times,
            "idle_steps": run.idle_steps, "outputs": {rid: len(t) for rid, t in run.outputs.items()}}
