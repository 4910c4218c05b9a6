"""Rank task of ``wsharding plan --serve --profile measure``: a step-time profile of the replicated and
the sharded model on these ranks, for :mod:`wsharding.serve.predict` to replay the scheduler against.

Each variant is built once. For every (token bucket, context bucket) a serving step can have, a
padding step of that shape is built and run (:func:`~wsharding.serve.step.build_step`, then
``forward_serve`` and the host's read of the next tokens, as the engine's step does): ``warmup``
untimed, then the median of ``repeats`` timed (a step of padding alone costs what a decode step of
its size does, so a step with a prefill chunk is priced as a decode step of its shape). The sharded model also has each sharded layer's gather
and compute timed at the smallest and the largest token bucket
(:func:`~wsharding.lab.tasks.serve.layer_times`). Every rank runs the same shapes in the same order, so
the sharded steps' gathers pair.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.sharding import WeightSharding
from wsharding.lab.tasks.planner import align_ranks
from wsharding.lab.tasks.serve import layer_times
from wsharding.linear import process_weights
from wsharding.models import ToyDecoder, decoder_config
from wsharding.models.kv_cache import kv_bytes_per_token, model_bytes, sharded_model_bytes
from wsharding.serve import BlockPool, activation_reserve_bytes
from wsharding.serve.step import build_step, context_buckets, token_buckets


def _time_steps(ctx: RankContext, model: ToyDecoder, sizes: list[int], widths: list[int], warmup: int,
                repeats: int) -> dict[str, float]:
    """Median seconds of a padding step per ``"{tokens}x{context}"`` (build, forward, the tokens read)."""
    pool = BlockPool.for_model(model, 1)
    out = {}
    with torch.no_grad():
        for n in sizes:
            for w in widths:
                times = []
                for i in range(warmup + repeats):
                    if i == warmup:
                        align_ranks(ctx)
                    began = time.perf_counter()
                    built = build_step(pool, [], [n], [w])
                    model.forward_serve(built.step).argmax(-1).tolist()
                    if i >= warmup:
                        times.append(time.perf_counter() - began)
                out[f"{n}x{w}"] = statistics.median(times)
    return out


def profile_rank(ctx: RankContext, preset: str, *, token_budget: int, max_len: int, layers: int | None = None,
                 comm: str = "torch", seed: int = 0, warmup: int = 2, repeats: int = 5) -> dict[str, Any]:
    """This rank's step times per shape of each variant, its sharded layers' gather and compute, and the
    sizing a prediction needs (resident bytes, activation reserve, KV bytes per token)."""
    cfg = decoder_config(preset, layers)
    comm_ = shard_comm_for(ctx, comm)
    device = comm_.device
    max_context = context_buckets(max_len)[-1]
    sizes, widths = token_buckets(token_budget), context_buckets(max_context)
    model = ToyDecoder(cfg, seed=seed, device=device).eval()
    process_weights(model)
    resident = {"replicated": model_bytes(model)}
    reserve = activation_reserve_bytes(model, token_budget, max_context)
    per_token = kv_bytes_per_token(model)
    steps = {"replicated": _time_steps(ctx, model, sizes, widths, warmup, repeats)}
    del model
    gc.collect()
    ws = WeightSharding(comm_, sharded_layers=range(1, cfg.layers))
    model = ToyDecoder(cfg, seed=seed, weight_sharding=ws, device=device).eval()
    process_weights(model)
    ws.finalize()
    resident["sharded"] = sharded_model_bytes(model, ws)
    steps["sharded"] = _time_steps(ctx, model, sizes, widths, warmup, repeats)
    probes = []
    for n in sorted({sizes[0], sizes[-1]}):
        align_ranks(ctx)
        probes += layer_times(model, ws, n, max_context, repeats)
    ws.close()
    layers_out = [{"layer": lt["layer"], "tokens": lt["tokens"], "width": lt["width"],
                   "payload_bytes": lt["payload_bytes"], "layout_bytes": lt["layout_bytes"],
                   "gather_s": None if lt["gather_us"] is None else lt["gather_us"] / 1e6,
                   "compute_s": None if lt["compute_us"] is None else lt["compute_us"] / 1e6} for lt in probes]
    emulation = comm_.emulation if device.type == "cuda" else ctx.emulation
    return {"rank": ctx.rank, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "emulation": emulation, "world_size": ctx.world_size, "preset": preset, "vocab": cfg.vocab,
            "token_budget": token_budget, "max_context": max_context, "steps": steps, "layers": layers_out,
            "sizing": {"resident_bytes": resident, "reserve_bytes": reserve, "kv_bytes_per_token": per_token}}


def profile_from_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One :class:`~wsharding.serve.predict.StepProfile` (as a dict) from every rank's
    :func:`profile_rank`: a replicated step is the mean over ranks (they run free), a sharded one the
    slowest rank's (they run aligned steps); the layers and sizing are rank 0's."""
    r0 = results[0]
    steps = {"replicated": {k: statistics.fmean(r["steps"]["replicated"][k] for r in results)
                            for k in r0["steps"]["replicated"]},
             "sharded": {k: max(r["steps"]["sharded"][k] for r in results) for k in r0["steps"]["sharded"]}}
    notes = [r0["emulation"]] if r0["emulation"] else []
    return {"kind": "step profile", "source": f"measured by wsharding plan --serve --profile measure, "
                                               f"{r0['world_size']} ranks on {r0['device']}",
            "device": r0["device"], "ranks": r0["world_size"], "preset": r0["preset"], "vocab": r0["vocab"],
            "token_budget": r0["token_budget"], "max_context": r0["max_context"], "steps": steps,
            "sizing": r0["sizing"], "layers": r0["layers"], "notes": notes}
