"""Rank tasks only the library's tests use: CUDA-graph replay, memory over many steps, and several
sharded decoders at once (the sharded-vs-replicated check itself is :mod:`wsharding.models.equality`).

Module level, importable as ``tests.ranktasks``: spawned ranks import tasks by module name (the rank
processes get the parent's ``sys.path``, which holds the repository root under pytest). They call the
library directly -- no teaching layer, no Jupyter stack -- so the GPU machine runs them as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.errors import Unsupported
from wsharding.core.runner import aligned_forward
from wsharding.cuda_graph import capture_graph
from wsharding.models import DecoderConfig, build_pair, decoder_config
from wsharding.models.equality import tokens_for


def graph_replay(ctx, preset: str | DecoderConfig, tokens: int, replays: int = 3,
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


def memory_over_steps(ctx, preset: str | DecoderConfig, steps: int, tokens: int = 8,
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


#: Locks kept for the life of the rank process, as tqdm keeps its one multiprocessing lock per process.
_KEPT_LOCKS: list[Any] = []


def keep_a_process_lock(ctx) -> int:
    """Make a multiprocessing lock (a named semaphore in a spawned rank) and keep it until the rank
    exits, as tqdm does for its bars; returns the rank."""
    import multiprocessing

    _KEPT_LOCKS.append(multiprocessing.RLock())
    return ctx.rank


def model_off_the_comm_device(ctx, comm: str = "torch") -> dict[str, Any]:
    """Shard a model built on the CPU over a GPU communicator (refused, naming the block and both
    devices), then the same model moved to the communicator's device (sharded, and it computes)."""
    from torch import nn

    from wsharding.core.runner import shard_blocks
    from wsharding.core.sharding import ShardingError

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(8, 8 * ctx.world_size, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc1(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            for block in self.layers:
                h = block(h[:, :8])
            return h

    c = shard_comm_for(ctx, comm)
    torch.manual_seed(0)
    model = Model()
    try:
        shard_blocks(model, "layers", ["fc1"], c)
        refused = None
    except ShardingError as e:
        refused = str(e)
    torch.manual_seed(0)
    moved = Model().to(c.device)
    ws = shard_blocks(moved, "layers", ["fc1"], c)
    h = torch.ones(1, 8, device=c.device)
    with torch.no_grad():
        h = moved(h)
    gathers = ws.planner.gathers_total
    ws.close()
    return {"rank": ctx.rank, "device": str(c.device), "refused": refused, "out_device": str(h.device),
            "gathers": gathers}
