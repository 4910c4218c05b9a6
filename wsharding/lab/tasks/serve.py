"""Rank task of ``wsharding bench serve``: the same requests served by the replicated and the sharded
model under the same memory budget (notebook 06's last section, the benchmark, tests).

Variants run one after the other on each rank, so only one model is resident while it serves: its KV
pool is the budget less what *it* holds (:func:`wsharding.serve.budget.pool_tokens`). Each variant
is built once and serves the workload once per budget.
"""

from __future__ import annotations

import gc
import statistics
from typing import Any

import torch
import torch.distributed as dist

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.core.sharding import WeightSharding
from wsharding.costmodel.bill import bill_for_layouts
from wsharding.lab.tasks.loading import outside_allocator_bytes
from wsharding.lab.tasks.planner import align_ranks
from wsharding.linear import process_weights
from wsharding.memory import PeakMeter
from wsharding.models import ToyDecoder, decoder_config
from wsharding.models.kv_cache import (
    kv_budget_bytes,
    kv_bytes_per_token,
    model_bytes,
    ranks_sharing_device,
    sharded_model_bytes,
)
from wsharding.models.token_pool import TokenKVPool
from wsharding.serve import Workload, activation_reserve_bytes, pool_tokens, serve
from wsharding.serve.batcher import ContinuousBatcher, check_fits

#: The variants every run serves; where the sharded one maps its own chunk (our NCCL, >= 2.30), a
#: third with plain slots shows what the mapping adds.
VARIANTS = ("replicated", "sharded")
PLAIN = "sharded_plain"


def _reduced(ctx: RankContext, value: int, op: dist.ReduceOp) -> int:
    """``value`` reduced over every rank (every rank calls it), on the device the process group uses."""
    if ctx.world_size == 1:
        return value
    t = torch.tensor([value], device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return int(t.item())


def _any_rank(ctx: RankContext, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank: after every step, "some rank still has work"."""
    return bool(_reduced(ctx, int(flag), dist.ReduceOp.MAX))


def _all_ranks_ready(ctx: RankContext, problem: Exception | None) -> None:
    """Raise on every rank when any rank cannot serve (its budget or requests were refused): a rank
    that raised alone would leave the others waiting in their first step's gather."""
    if _any_rank(ctx, problem is not None) and problem is None:
        raise InvalidArgument(f"rank {ctx.rank}: another rank refused its budget or requests (its error says why)")
    if problem is not None:
        raise problem


def _build(variant: str, cfg, comm, seed: int) -> tuple[ToyDecoder, WeightSharding | None, dict[str, Any]]:
    """One variant, its build measured (the load peak: device bytes on GPUs, the resident set on CPU ranks)."""
    gc.collect()
    outside = outside_allocator_bytes(comm) if variant != "replicated" else None
    with PeakMeter(comm.device, outside_allocator=outside) as meter:
        if variant == "replicated":
            model, ws = ToyDecoder(cfg, seed=seed, device=comm.device).eval(), None
            process_weights(model)
        else:
            ws = WeightSharding(comm, sharded_layers=range(1, cfg.layers),
                                map_own_chunk=False if variant == PLAIN else "auto")
            model = ToyDecoder(cfg, seed=seed, weight_sharding=ws, device=comm.device).eval()
            process_weights(model)
            ws.finalize(observe=lambda stage, layer: meter.sample())
    peak = meter.result
    return model, ws, {"load_peak_bytes": peak.device_peak_bytes, "load_peak_is_host": peak.device_is_host}


def _layer_times(model: ToyDecoder, ws: WeightSharding, rows: int, max_len: int, steps: int) -> list[dict[str, float]]:
    """Per sharded layer, the median gather time and compute time (µs) of ``steps`` traced full steps."""
    pool = TokenKVPool.for_model(model, 1)
    idle = ContinuousBatcher(pool, [], rows=rows, max_len=max_len, device=pool.k.device)
    planner = ws.planner
    planner.trace_enabled = True
    traces = []
    try:
        with torch.no_grad():
            for _ in range(steps):
                model.forward_serve(idle.next_step(0.0)).argmax(-1).tolist()
                traces.append(planner.finish_step())
    finally:
        planner.trace_enabled = False
        planner.traces.clear()
    out = []
    for layer in sorted(ws.layouts):
        marks = [t.layers.get(layer, {}) for t in traces]
        gather = [m["gather_end"] - m["gather_start"] for m in marks if "gather_end" in m and "gather_start" in m]
        compute = [m["compute_end"] - m["compute_start"] for m in marks if "compute_end" in m]
        out.append({"layer": layer, "gather_us": statistics.median(gather) if gather else None,
                    "compute_us": statistics.median(compute) if compute else None})
    return out


def serve_rank(ctx: RankContext, preset: str, *, workload: dict[str, Any], budgets: list[int | None],
               rows: int, reserve_bytes: int | None = None, comm: str = "torch", layers: int | None = None,
               seed: int = 0, probe_steps: int = 3) -> dict[str, Any]:
    """Serve this rank's requests with each variant under each budget (bytes per rank; None: what the
    GPU has free now, split between the ranks on it -- CPU ranks need a number, an emulated budget).

    Returns, per budget and variant, :meth:`ServeRun.summary` plus the pool's sizing, the load peak and
    (sharded) per-layer gather and compute times; and the requests whose tokens differ from the
    replicated model's in any sharded variant. Variants: :data:`VARIANTS`, and :data:`PLAIN` where
    the sharded one maps its own chunk.
    """
    cfg = decoder_config(preset, layers)
    comm_ = shard_comm_for(ctx, comm)
    device = comm_.device
    share = ranks_sharing_device(ctx.world_size, device)
    if device.type == "cuda":
        # one budget for every rank: the least free
        free_now = _reduced(ctx, kv_budget_bytes(device, share=share)[0], dist.ReduceOp.MIN)
        budgets = [free_now if b is None else b for b in budgets]
    elif any(b is None for b in budgets):
        raise InvalidArgument("serve_rank: CPU ranks need an explicit (emulated) budget in bytes")
    wl = Workload.from_dict(workload)
    requests = wl.for_rank(ctx.rank, cfg.vocab)
    runs: dict[str, list[dict[str, Any]]] = {}
    outputs: dict[str, list[dict[int, list[int]]]] = {}
    sizing: dict[str, dict[str, Any]] = {}
    variants = list(VARIANTS)
    for variant in variants:  # grows by PLAIN when the sharded variant maps its own chunk
        model, ws, load = _build(variant, cfg, comm_, seed)
        if variant == "sharded" and ws.map_own_chunk:
            variants.append(PLAIN)
        resident = model_bytes(model) if ws is None else sharded_model_bytes(model, ws)
        reserve = activation_reserve_bytes(model, rows, wl.max_len) if reserve_bytes is None else reserve_bytes
        sizing[variant] = {"resident_bytes": resident, "reserve_bytes": reserve, **load}
        if ws is not None:
            bill = bill_for_layouts(list(ws.layouts.values()), ranks=comm_.world_size, map_own_chunk=ws.map_own_chunk,
                                    granularity=comm_.alloc_granularity)
            sizing[variant].update({"net_saving_bytes_predicted": bill.net_saving_bytes,
                                    "map_own_chunk": ws.map_own_chunk, "slot_layout": ws.map_own_chunk_reason})
            sizing[variant]["layer_times"] = _layer_times(model, ws, rows, wl.max_len, probe_steps)
        runs[variant], outputs[variant] = [], []
        per_token = kv_bytes_per_token(model)
        for budget in budgets:
            problem = None
            try:
                tokens = pool_tokens(budget, resident, reserve, per_token)
                if device.type == "cuda":
                    room = kv_budget_bytes(device, share=share)[0]
                    if (tokens + 1) * per_token > room:
                        raise InvalidArgument(
                            f"rank {ctx.rank}: a budget of {budget / 2**30:.2f} GiB asks for a KV pool of "
                            f"{(tokens + 1) * per_token / 2**30:.2f} GiB, but only {room / 2**30:.2f} GiB is free for "
                            "this rank on its GPU: give a smaller --budget-gib")
                pool = TokenKVPool.for_model(model, tokens)
                check_fits(requests, pool, rows, wl.max_len)
            except WshardingError as e:
                problem = e
            _all_ranks_ready(ctx, problem)
            align_ranks(ctx)
            run = serve(model, pool, requests, rows=rows, max_len=wl.max_len, agree=lambda has_work: _any_rank(ctx, has_work))
            runs[variant].append({"budget_bytes": budget, "pool_bytes": pool.nbytes, **run.summary(),
                                  "ttft_s": run.ttft_s, "tpot_s": run.tpot_s})
            outputs[variant].append(run.outputs)
            del pool
            gc.collect()
        if ws is not None:
            ws.close()
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    differ = [sorted({rid for v in variants[1:] for rid in outputs["replicated"][i]
                      if outputs["replicated"][i][rid] != outputs[v][i].get(rid)}) for i in range(len(budgets))]
    # ranks sharing a GPU meet over gloo (a CPU context) but serve on the GPU: the communicator says what is emulated
    emulation = comm_.emulation if device.type == "cuda" else ctx.emulation
    return {"rank": ctx.rank, "mode": comm_.mode, "emulation": emulation, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "communicator": type(comm_).__name__, "world_size": ctx.world_size, "ranks_per_device": share,
            "kv_bytes_per_token": per_token,
            "budgets": budgets, "sizing": sizing, "runs": runs, "differ": differ, "workload": wl.as_dict(),
            "workload_text": wl.describe(),
            "kv_tokens_mean": statistics.fmean(r.kv_tokens for r in requests), "rows": rows, "max_len": wl.max_len, "preset": preset,
            "layers": cfg.layers}
