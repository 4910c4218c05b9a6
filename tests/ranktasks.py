"""Rank tasks the library's tests share: the sharded decoder against its replicated twin.

Module level, importable as ``tests.ranktasks``: spawned ranks import tasks by module name (the rank
processes get the parent's ``sys.path``, which holds the repository root under pytest). They call the
library directly -- no teaching layer, no Jupyter stack -- so the GPU machine runs them as they are.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from wsharding.accel.next_step import NextStepPrefetch
from wsharding.core.comm import is_slice_of
from wsharding.core.errors import Unsupported
from wsharding.core.runner import aligned_forward
from wsharding.cuda_graph import capture_graph
from wsharding.models import DecoderConfig, build_pair, decoder_config
from wsharding.models.kv_cache import model_bytes, sharded_model_bytes


def tokens_for(rank: int, step: int, counts: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``counts[step][rank]`` seeded token ids for this rank (0: an idle rank)."""
    n = counts[step % len(counts)][rank % len(counts[0])]
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7919 * rank + step)).to(device)


def shard_comm(ctx, comm: str = "torch", group_size: int | None = None):
    """torch.distributed (``"torch"``) or our NCCL communicator (``"nccl"``) over this rank's shard
    group; ours is created once per rank and group size (creating one is collective and slow)."""
    g = ctx.world_size if group_size is None else group_size
    if comm == "torch":
        return ctx.shard_comm(g)
    key = f"tests.nccl_comm.g{g}"
    if key not in ctx.store:
        from wsharding.accel.nccl import from_context

        ctx.store[key] = from_context(ctx, group_size=None if g == ctx.world_size else g)
    return ctx.store[key]


def shared_gpu_ready() -> bool:
    """Several ranks may share this machine's GPU with our NCCL communicator: CUDA, a libnccl that
    has NCCL's multi-rank-per-GPU mode, and ``NCCL_MULTI_RANK_GPU_ENABLE=1``."""
    if not torch.cuda.is_available() or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        return False
    from wsharding.accel.nccl.library import NcclLibraryError, default_library

    try:
        return bool(default_library().describe().get("multi_rank_per_gpu"))
    except NcclLibraryError:
        return False


def sharded_vs_replicated(ctx, preset: str | DecoderConfig, counts: list[list[int]], *, lookahead: bool = True,
                          group_size: int | None = None, comm: str = "torch", prefetch_next_step: bool = False,
                          map_own_chunk: bool | str = False, close: bool = False) -> dict[str, Any]:
    """Run ``len(counts)`` steps of the replicated and the sharded decoder (idle ranks: the dummy step)
    and compare their outputs bit for bit; with the sharding's byte counts. ``close``: close the
    sharding, and report the communicator pool's bytes before the build and after the close."""
    cfg = decoder_config(preset)
    comm = shard_comm(ctx, comm, group_size)
    pool = comm.pool
    pool_before = pool.allocated_bytes if pool is not None else None
    replicated, sharded = build_pair(cfg, comm, seed=0, lookahead=lookahead, map_own_chunk=map_own_chunk)
    ws = sharded.weight_sharding
    next_step = NextStepPrefetch.switch(ws.planner, prefetch_next_step)
    equal, max_diff, gathers, waits = [], 0.0, [], []
    with torch.no_grad():
        for step in range(len(counts)):
            x = tokens_for(ctx.rank, step, counts, cfg.vocab, comm.device)
            out = aligned_forward(sharded, x, sharded.dummy_tokens)
            gathers.append(ws.planner.gathers_this_step)
            waits.append(ws.planner.waits_this_step)
            if out is None:
                equal.append(None)
                continue
            ref = replicated(x)
            equal.append(bool(torch.equal(ref, out)))
            max_diff = max(max_diff, float((ref.float() - out.float()).abs().max()))
    if hasattr(comm, "group_ranks"):
        group = list(comm.group_ranks)
    else:
        import torch.distributed as dist

        group = list(dist.get_process_group_ranks(comm.group)) if comm.group is not None else list(range(ctx.world_size))
    result = {
        "rank": ctx.rank, "mode": comm.mode, "group": group, "equal": equal, "max_abs_diff": max_diff,
        "gathers": gathers, "waits": waits, "next_step_prefetches": next_step.prefetches if next_step is not None else 0,
        "sharded_layers": ws.sharded_layer_ids,
        "in_place_gathers": sum(is_slice_of(ws.slots.gather_chunk(i, ws.chunks[i]), ws.slots.full_buffer(i), comm.rank)
                                for i in ws.sharded_layer_ids),
        "replicated_bytes": ws.replicated_bytes(), "resident_bytes": ws.resident_bytes(),
        "formula_bytes": ws.formula_bytes(), "slot_bytes": ws.slots.slot_bytes,
        "chunk_bytes": [ws.layouts[i].chunk_bytes for i in ws.sharded_layer_ids],
        "layout_bytes": [ws.layouts[i].total_bytes for i in ws.sharded_layer_ids],
        "pool_bytes_sharded": pool.allocated_bytes - pool_before if pool is not None else None,
        "model_bytes": {"replicated": model_bytes(replicated), "sharded": sharded_model_bytes(sharded, ws)},
        "map_own_chunk": ws.map_own_chunk, "map_own_chunk_reason": ws.map_own_chunk_reason,
    }
    if close:
        ws.close()
        result["pool_bytes"] = (pool_before, pool.allocated_bytes if pool is not None else None)
    return result


def graph_replay(ctx, preset: str | DecoderConfig, tokens: int, replays: int = 3,
                 group_size: int | None = None, comm: str = "torch") -> dict[str, Any]:
    """CUDA only: capture the sharded model's step -- gathers on the side stream, gate and ready
    events, layer compute -- in one CUDA graph, replay it on new tokens, compare with eager and with
    the replicated model."""
    cfg = decoder_config(preset)
    comm = shard_comm(ctx, comm, group_size)
    if comm.device.type != "cuda":
        raise Unsupported("graph_replay needs CUDA ranks")
    replicated, sharded = build_pair(cfg, comm, lookahead=True)
    dev = comm.device
    static = torch.zeros(tokens, dtype=torch.long, device=dev)
    results = []
    with torch.no_grad():
        graph, static_out = capture_graph(lambda: sharded(static), dev)
        for r in range(replays):
            x = tokens_for(ctx.rank, r, [[tokens]], cfg.vocab, dev)
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize(dev)
            eager = sharded(x)
            ref = replicated(x)
            results.append((bool(torch.equal(static_out, eager)), bool(torch.equal(static_out, ref))))
    return {"rank": ctx.rank, "mode": comm.mode, "replays": results, "gathers_captured": sharded.planner.gathers_this_step}


def memory_over_steps(ctx, preset: str | DecoderConfig, steps: int, tokens: int = 8,
                      comm: str = "torch") -> dict[str, Any]:
    """Allocated device memory (CUDA) after a warm-up and after ``steps`` more steps: must not grow."""
    cfg = decoder_config(preset)
    comm = shard_comm(ctx, comm)
    _, sharded = build_pair(cfg, comm)
    dev = comm.device
    with torch.no_grad():
        for s in range(3):
            sharded(tokens_for(ctx.rank, s, [[tokens]], cfg.vocab, dev))
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        for s in range(steps):
            sharded(tokens_for(ctx.rank, s, [[tokens]], cfg.vocab, dev))
        torch.cuda.synchronize(dev)
        after = torch.cuda.memory_allocated(dev)
    return {"rank": ctx.rank, "before": before, "after": after, "gathers": sharded.planner.gathers_total}


def parallel_model_equality(ctx, preset: str | DecoderConfig, counts: list[list[int]], *,
                            moe_tp: bool = True, merge_front: bool = False, lookahead: bool = True,
                            seed: int = 0) -> dict[str, Any]:
    """The decoder built with **DP attention** (attention on ``attn_tp``, of size 1: every rank its own
    tokens) and, with ``moe_tp``, a **TP MoE** shared expert (``shared_experts_tp`` over all ranks), its
    targets decided by their groups; sharded against unsharded, bit for bit, over ``counts`` steps.

    ``merge_front``: the decoder's storage-changing fusion, which the sharded layers must skip. The
    reference is then built without it, so that both compute the same GEMMs.
    """
    from wsharding.core.sharding import WeightSharding
    from wsharding.linear import ParallelState, parallel_state
    from wsharding.models import ToyDecoder

    base = decoder_config(preset)
    cfg = base.with_(attn_group="attn_tp", moe_group="shared_experts_tp" if moe_tp else "replicated",
                     merge_front=merge_front)
    comm = shard_comm(ctx, "torch")
    state = ParallelState.from_dist(ctx, attn_dp_size=ctx.world_size)  # attn_tp size 1: DP attention
    with parallel_state(state):
        replicated = ToyDecoder(cfg.with_(merge_front=False), seed=seed, device=comm.device).eval()
        ws = WeightSharding(comm, sharded_layers=range(1, cfg.layers), lookahead=lookahead)
        sharded = ToyDecoder(cfg, seed=seed, weight_sharding=ws, device=comm.device).eval()
        ws.finalize()
    equal, max_diff = [], 0.0
    with torch.no_grad():
        for step in range(len(counts)):
            x = tokens_for(ctx.rank, step, counts, cfg.vocab, comm.device)
            out_s = aligned_forward(sharded, x, sharded.dummy_tokens)
            out_r = aligned_forward(replicated, x, replicated.dummy_tokens)  # collectives of the TP MoE pair up
            if out_s is None:
                equal.append(None)
                continue
            equal.append(bool(torch.equal(out_r, out_s)))
            max_diff = max(max_diff, float((out_r.float() - out_s.float()).abs().max()))
    layer1 = sharded.layers[1]
    return {
        "rank": ctx.rank, "equal": equal, "max_abs_diff": max_diff,
        "attn_tp_size": state.attn_tp_size,
        "report": ws.report(),
        "targets": {i: [t.name for t in ts] for i, ts in ws.targets.items()},
        "shared_gate_up_shape": list(layer1.moe.shared_expert.gate_up_proj.weight.shape),
        "fusions": {i: dict(layer.fusions) for i, layer in enumerate(sharded.layers)},
        "reference_fusions": {i: dict(layer.fusions) for i, layer in enumerate(replicated.layers)},
        "replicated_bytes": ws.replicated_bytes(), "resident_bytes": ws.resident_bytes(),
        "formula_bytes": ws.formula_bytes(),
    }
