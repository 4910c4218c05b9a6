"""Rank tasks for the sharded decoder: equality against the replicated twin, and timed steps.

They live in the package because spawned ranks import tasks by name; tests, the demo and the
notebooks all call them.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.comm.base import is_slice_of
from wsharding.context import RankContext
from wsharding.cuda_graph import capture_graph
from wsharding.errors import InvalidArgument, Unsupported
from wsharding.models import DecoderConfig, build_pair, decoder_config
from wsharding.models.kv_cache import model_bytes, sharded_model_bytes
from wsharding.runner import aligned_forward


def tokens_for(rank: int, step: int, counts: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """This rank's tokens at ``step``: ``counts[step][rank]`` ids (0 means an idle rank)."""
    n = counts[step % len(counts)][rank % len(counts[0])]
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randint(0, vocab, (n,), generator=g).to(device)


def ours_supported() -> bool:
    """True when this machine can run our NCCL communicator: CUDA, and a libnccl with symmetric
    windows and the copy engine (>= 2.28.3)."""
    if not torch.cuda.is_available():
        return False
    from wsharding.comm.nccl.library import NcclLibraryError, default_library

    try:
        return bool(default_library().describe().get("copy_engine_allgather"))
    except NcclLibraryError:
        return False


def multi_rank_per_gpu_supported() -> bool:
    """True when several ranks may share this machine's GPU with our NCCL communicator: a GPU, a
    libnccl >= 2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL's multi-rank-per-GPU mode)."""
    import os

    if not torch.cuda.is_available() or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        return False
    from wsharding.comm.nccl.library import NcclLibraryError, default_library

    try:
        return bool(default_library().describe().get("multi_rank_per_gpu"))
    except NcclLibraryError:
        return False


def shard_comm_for(ctx: RankContext, comm: str = "torch", group_size: int | None = None):
    """The communicator the sharded layers gather with, over this rank's shard group.

    ``group_size`` (default: the whole world) cuts the world into groups ``(rank // g) * g``, as the
    intra-node groups of 8 of SGLang's weight sharding for Kimi K3; each group shards one copy of the
    weights between its members.
    ``"torch"``: torch.distributed over this rank's shard group (gloo on CPU, NCCL on GPUs).
    ``"nccl"``: our ctypes NCCL communicator over the group -- one unique id per group, buffers from
    ``ncclMemAlloc`` registered as symmetric windows of the group, CTA policy 2, so gathers take the
    copy-engine path. Created once per rank and group size, kept in ``ctx.store`` (creating a
    communicator is collective and slow).
    ``"auto"``: ``"nccl"`` when :func:`ours_supported`, else ``"torch"``.
    """
    if comm == "auto":
        comm = "nccl" if ours_supported() else "torch"
    g = ctx.world_size if group_size is None else min(group_size, ctx.world_size)
    if comm == "torch":
        return ctx.shard_comm(g)
    if comm != "nccl":
        raise InvalidArgument(f"unknown communicator {comm!r}: use 'torch', 'nccl' or 'auto'")
    key = "_wsharding_nccl_comm" if g == ctx.world_size else f"_wsharding_nccl_comm.g{g}"
    if key not in ctx.store:
        from wsharding.comm.nccl import from_context

        ctx.store[key] = from_context(ctx, group_size=None if g == ctx.world_size else g)
    return ctx.store[key]


def is_ours(comm: Any) -> bool:
    """True when ``comm`` is our NCCL communicator: what only it has (its gather stream, watchdog,
    issue thread and group list) is read after this check, not probed for."""
    from wsharding.comm.nccl.communicator import NcclCommunicator

    return isinstance(comm, NcclCommunicator)


def graph_unsupported(comm: Any) -> str | None:
    """Why a step over ``comm`` cannot be captured in a CUDA graph here, or None when it can (the
    rule of ``bench step --graph`` and ``demo --graph``)."""
    if comm.device.type != "cuda":
        return "CUDA graphs need GPUs (these are CPU ranks)"
    if comm.world_size == 1:
        return None
    if not is_ours(comm):
        return "capturing gathers needs our NCCL communicator (--comm nccl)"
    if comm.shared_gpu:
        return "several ranks share one GPU: capturing their gathers hung when tried there"
    return None


def group_of(comm: Any) -> list[int]:
    """Global ranks of a communicator's shard group (either backend), in group order."""
    if is_ours(comm):
        return list(comm.group_ranks)
    import torch.distributed as dist

    group = comm.group  # TorchDistComm: None is the whole world
    return list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))


def model_equality(ctx: RankContext, preset: str | DecoderConfig, counts: list[list[int]], *, lookahead: bool = True,
                   group_size: int | None = None, seed: int = 0, comm: str = "torch",
                   prefetch_next_step: bool = False, map_own_chunk: bool | str = False,
                   close: bool = False, issue_thread: bool = False) -> dict[str, Any]:
    """Build the replicated and sharded models, run ``len(counts)`` steps with ``counts[step][rank]``
    tokens on this rank (idle ranks run a one-token dummy step), compare outputs bit for bit.
    ``prefetch_next_step``: the planner's [Note: the next step's first gather]; ``map_own_chunk``:
    [Note: the own chunk mapped, not copied] (``in_place_gathers`` counts the gathers that copy nothing
    of their own); plain slots unless asked, ``"auto"`` as the package's default. ``close``: close the sharding at the end and report the communicator's device
    bytes before the build and after the close (our NCCL communicator; None for the others).
    ``issue_thread``: the gathers issued by our NCCL communicator's native thread ([Note: the issue
    thread]); it is stopped again at the end (the communicator is kept for later tasks)."""
    cfg = decoder_config(preset)
    comm_name, comm = comm, shard_comm_for(ctx, comm, group_size)
    if issue_thread:
        comm.set_issue_thread(True)  # the same communicator again below (kept in ctx.store)
        try:
            return model_equality(ctx, preset, counts, lookahead=lookahead, group_size=group_size, seed=seed,
                                  comm=comm_name, prefetch_next_step=prefetch_next_step, map_own_chunk=map_own_chunk,
                                  close=close) | {"issue_thread_pushes": comm.issuer.pushes}
        finally:
            comm.set_issue_thread(False)
    pool = comm.pool
    pool_before = pool.allocated_bytes if pool is not None else None
    replicated, sharded = build_pair(cfg, comm, seed=seed, lookahead=lookahead, map_own_chunk=map_own_chunk)
    ws = sharded.weight_sharding
    ws.planner.prefetch_next_step = prefetch_next_step
    equal, max_diff, gathers, waits = [], 0.0, [], []
    with torch.no_grad():
        for step in range(len(counts)):
            x = tokens_for(ctx.rank, step, counts, cfg.vocab, comm.device)
            out_s = aligned_forward(sharded, x, sharded.dummy_tokens)
            gathers.append(ws.planner.gathers_this_step)
            waits.append(ws.planner.waits_this_step)
            if out_s is None:
                equal.append(None)
                continue
            out_r = replicated(x)
            equal.append(bool(torch.equal(out_r, out_s)))
            max_diff = max(max_diff, float((out_r.float() - out_s.float()).abs().max()))
    result = {
        "rank": ctx.rank,
        "equal": equal,
        "max_abs_diff": max_diff,
        "gathers": gathers,
        "waits": waits,
        "next_step_prefetches": ws.planner.next_step_prefetches,
        # the gather's own rule for "nothing of its own to copy" (NcclPreparedGather.in_place)
        "in_place_gathers": sum(is_slice_of(ws.slots.gather_chunk(i, ws.chunks[i]), ws.slots.full_buffer(i), comm.rank)
                                for i in ws.sharded_layer_ids),
        "sharded_layers": ws.sharded_layer_ids,
        "replicated_bytes": ws.replicated_bytes(),
        "resident_bytes": ws.resident_bytes(),
        "formula_bytes": ws.formula_bytes(),
        "slot_bytes": ws.slots.slot_bytes,
        "chunk_bytes": [ws.layouts[i].chunk_bytes for i in ws.sharded_layer_ids],
        # what the communicator's allocator holds for this sharding (our NCCL communicator): the
        # resident bytes seen from the other side
        "pool_bytes_sharded": pool.allocated_bytes - pool_before if pool is not None else None,
        "layout_bytes": [ws.layouts[i].total_bytes for i in ws.sharded_layer_ids],
        # what the KV-cache comparison counts for each model (kv_cache.model_bytes): the sharded one's
        # mapped layer views own no memory and must not count
        "model_bytes": {"replicated": model_bytes(replicated), "sharded": sharded_model_bytes(sharded, ws)},
        "mode": comm.mode,
        "group": group_of(comm),
        "map_own_chunk": ws.map_own_chunk,
        "map_own_chunk_reason": ws.map_own_chunk_reason,
    }
    if close:
        ws.close()
        result["pool_bytes"] = (pool_before, pool.allocated_bytes if pool is not None else None)
    return result


def graph_replay(ctx: RankContext, preset: str | DecoderConfig, tokens: int, replays: int = 3,
                 group_size: int | None = None, comm: str = "torch") -> dict[str, Any]:
    """CUDA only: capture the sharded model's step -- gathers on the side stream, gate and ready
    events, layer compute -- in one CUDA graph, replay it on new tokens, compare with eager and with
    the replicated model."""
    cfg = decoder_config(preset)
    comm = shard_comm_for(ctx, comm, group_size)
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


def memory_over_steps(ctx: RankContext, preset: str | DecoderConfig, steps: int, tokens: int = 8,
                      comm: str = "torch") -> dict[str, Any]:
    """Allocated device memory (CUDA) after a warm-up and after ``steps`` more steps: must not grow."""
    cfg = decoder_config(preset)
    comm = shard_comm_for(ctx, comm)
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


def parallel_model_equality(ctx: RankContext, preset: str | DecoderConfig, counts: list[list[int]], *,
                            moe_tp: bool = True, merge_front: bool = False, lookahead: bool = True,
                            seed: int = 0) -> dict[str, Any]:
    """The decoder built with **DP attention** (attention on ``attn_tp``, of size 1: every rank its own
    tokens) and, with ``moe_tp``, a **TP MoE** shared expert (``shared_experts_tp`` over all ranks), its
    targets decided by their groups; sharded against unsharded, bit for bit, over ``counts`` steps.

    ``merge_front``: the decoder's storage-changing fusion, which the sharded layers must skip. The
    reference is then built without it, so that both compute the same GEMMs.
    """
    from wsharding.linear import ParallelState, parallel_state
    from wsharding.models import ToyDecoder
    from wsharding.shard import WeightSharding

    base = decoder_config(preset)
    cfg = base.with_(attn_group="attn_tp", moe_group="shared_experts_tp" if moe_tp else "replicated",
                     merge_front=merge_front)
    comm = shard_comm_for(ctx, "torch")
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
