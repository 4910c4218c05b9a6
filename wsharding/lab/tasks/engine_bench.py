"""Rank task of ``wsharding bench serve --engine transformers``: the package's serving benchmark --
the same workload, budgets, SLO and pairing -- with transformers' continuous batching as the engine.

Every rank builds a Llama twice, once (random weights from one seed, no download): the replicated
model and a copy whose attention and MLP projections are sharded over the ranks. At every (budget,
rate, trial) point both serve the **same arrivals** (:meth:`wsharding.serve.workload.Workload.for_rank`,
rescaled to the rate), one after the other, the first alternating per trial, each through a fresh
:class:`~wsharding.engines.transformers_cb.AlignedEngine` whose KV pool is what the budget leaves
after *that* model's resident bytes and the reserve (:mod:`wsharding.engines.cb_budget`): the sharded
model holds less, so its pool is larger. The sharded engines run **aligned** (one agreement per round,
dummy steps while a peer works); the replicated ones run **free** -- the same engine loop over an
agreement of one rank (:class:`LocalComm`): no collective, no dummy step, each rank stops when its
own work is done, as replicas do.

[Note: the engine's token check]
transformers' engine batches as requests arrive, so two runs on the same arrivals but other pools
(or other host timings) may batch a request with others, and a kernel of another batch shape may
round the last bit otherwise: the timed runs' tokens are compared (``own_differ``) but not required
equal. The check that is required: per (budget, rate), both variants serve the first trial's requests
once more with the replicated pool's size, **every request queued before the engine starts** -- the
engine's FIFO scheduler then forms the same batches in both, the sharded forward equals the
replicated one bit for bit on the same batch, so every token of every request on every rank must be
equal (``differ``, which the command turns into an error when not empty).
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.core.runner import shard_blocks
from wsharding.engines.cb_budget import check_engine_pool, engine_pool_blocks, engine_reserve_bytes, kv_block_bytes
from wsharding.engines.transformers_cb import AlignedEngine
from wsharding.lab.tasks.loading import HF_LLAMA_PATTERNS
from wsharding.lab.tasks.planner import align_ranks
from wsharding.models.kv_cache import model_bytes, ranks_sharing_device, sharded_model_bytes
from wsharding.serve.budget import resolve_budget
from wsharding.serve.workload import Request, Workload, realised_rate

VARIANTS = ("replicated", "sharded")

#: Llama shapes the command builds from a config (random weights, no download): ``tiny`` for CPU
#: ranks (float32), the others for a GPU (bfloat16), Llama 3.2 1B and 3B's shapes.
LLAMAS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, dtype="float32"),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, dtype="bfloat16"),
    "llama-3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                     num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=8192, dtype="bfloat16"),
}


class LocalComm:
    """The agreement of one rank (:class:`~wsharding.engines.transformers_cb.StepAgreement` of world size
    1 makes no collective): the replicated engine runs the aligned engine's loop, free."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size = rank, 1


def llama_config(name: str, layers: int | None = None) -> Any:
    """The ``LlamaConfig`` of :data:`LLAMAS` ``name`` (``layers``: that many decoder layers)."""
    from transformers import LlamaConfig

    if name not in LLAMAS:
        raise InvalidArgument(f"engine model {name!r}: use one of {', '.join(LLAMAS)}")
    kw = dict(LLAMAS[name])
    dtype = kw.pop("dtype")
    if layers is not None:
        kw["num_hidden_layers"] = layers
    config = LlamaConfig(tie_word_embeddings=False, **kw)
    config.dtype = dtype
    return config


def build(config: Any, seed: int, device: torch.device) -> Any:
    """``LlamaForCausalLM(config)`` made on ``device`` from ``seed`` in the config's dtype, eval mode: two
    calls give the same weights bit for bit."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(getattr(torch, str(config.dtype).removeprefix("torch."))).eval()


def engine_configs(max_new_tokens: int, num_blocks: int, page_size: int, max_batch_tokens: int,
                   max_requests: int) -> tuple[Any, Any]:
    """A greedy ``GenerationConfig`` (no end of sequence: a request stops at its output length, as the
    package's workload says) and a ``ContinuousBatchingConfig`` of exactly ``num_blocks`` blocks; no CUDA
    graphs, no asynchronous batching (refused on a sharded model), eager attention kernels kept as the
    model has them (no switch to flash: both variants run the same kernels)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=max_requests, use_cuda_graph=False, use_async_batching=False,
                                  auto_switch_to_flash=False)
    return gen, cb


def serve_once(ctx: RankContext, model: Any, comm: Any, requests: list[Request], cfgs: tuple[Any, Any], *,
               num_blocks: int, block_bytes: int, queued: bool = False) -> dict[str, Any]:
    """One run of one variant: a fresh engine of ``num_blocks`` blocks (checked once built), this rank's
    ``requests`` added at their arrival times (``queued``: all of them before the engine starts, [Note: the
    engine's token check]); per request the record :func:`~wsharding.serve.metrics.trial_metrics` reads
    (times in seconds since the run's start, from the engine's own per-token timestamps), the tokens,
    and the engine's counts."""
    gen, cb = cfgs
    engine = AlignedEngine(model, comm, generation_config=gen, cb_config=cb)
    align_ranks(ctx)
    ids = [f"r{r.rid}" for r in requests]
    if queued:
        for r, rid in zip(requests, ids, strict=True):
            engine.add_request(r.prompt, max_new_tokens=r.output, request_id=rid, record_timestamps=True)
    engine.start()
    try:
        check_engine_pool(engine.manager, num_blocks, block_bytes)
        t0 = time.perf_counter()
        if not queued:
            for r, rid in zip(requests, ids, strict=True):
                time.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
                engine.add_request(r.prompt, max_new_tokens=r.output, request_id=rid, record_timestamps=True)
        outputs = engine.results(ids)
        wall = time.perf_counter() - t0
    finally:
        engine.stop()
    records = []
    for r, rid in zip(requests, ids, strict=True):
        o = outputs[rid]
        if len(o.generated_tokens) != r.output:
            raise WshardingError(f"rank {ctx.rank}: request {rid} ended after {len(o.generated_tokens)} of its "
                                 f"{r.output} tokens (the engine stopped it early)")
        records.append({"rid": r.rid, "rank": ctx.rank, "arrival_s": r.arrival_s,
                        "sent_s": (t0 if queued else o.created_time) - t0,
                        "token_s": [t - t0 for t in o.timestamps], "prompt_tokens": len(r.prompt),
                        "output_tokens": len(o.generated_tokens), "preempted": engine.preemptions.get(rid, 0)})
    c = engine.counters
    return {"records": records, "tokens": {r.rid: list(outputs[f"r{r.rid}"].generated_tokens) for r in requests},
            "preemptions": sum(engine.preemptions.values()), "idle_steps": c.idle_steps, "steps": c.steps,
            "rounds": c.rounds, "agree_s": c.agree_s, "wall_s": wall, "kv_peak_blocks": c.kv_peak_blocks}


def engine_bench_rank(ctx: RankContext, model_name: str, *, workload: dict[str, Any], budgets: list[dict[str, Any]],
                      rates: list[float | None], trials: int = 1, max_batch_tokens: int = 64, max_requests: int = 8,
                      page_size: int = 16, reserve_bytes: int | None = None, comm: str = "torch",
                      layers: int | None = None, seed: int = 0, check: bool = True) -> dict[str, Any]:
    """Serve this rank's requests with both variants under each budget, at each rate (None: all at
    once), ``trials`` times with other seeds, interleaved per point; then, per (budget, rate), the token
    check ([Note: the engine's token check]). Returns the runs (records, tokens, counts), each variant's
    pool per budget, the sizing, ``differ`` (requests whose tokens differ in the check: must be empty)
    and ``own_differ`` (in the first trial's timed runs: informative)."""
    config = llama_config(model_name, layers)
    sharded_comm = shard_comm_for(ctx, comm)
    # where the gathers land, as the package's own serve task builds: a rank of a CPU-side group (gloo
    # between ranks that share a GPU through our NCCL communicator) has a CPU context and a CUDA comm
    device = sharded_comm.device
    share = ranks_sharing_device(ctx.world_size, device)
    base = Workload.from_dict(workload)
    max_context = base.max_len + 1
    if max_context > config.max_position_embeddings:
        raise InvalidArgument(f"the workload's longest request ({max_context} tokens) is longer than the model's "
                              f"{config.max_position_embeddings} positions")
    replicated = build(config, seed, device)
    sharded = build(config, seed, device)
    ws = shard_blocks(sharded, "model.layers", list(HF_LLAMA_PATTERNS), sharded_comm)
    models = {"replicated": (replicated, LocalComm(ctx.rank)), "sharded": (sharded, ws.comm)}
    dtype = replicated.dtype
    block_bytes = kv_block_bytes(config, page_size, dtype)
    reserve = engine_reserve_bytes(config, dtype, max_batch_tokens, max_requests, max_context) \
        if reserve_bytes is None else reserve_bytes
    resident = {"replicated": model_bytes(replicated), "sharded": sharded_model_bytes(sharded, ws)}
    resolved = [resolve_budget(s, resident["replicated"], reserve, device, share) for s in budgets]
    pools: dict[str, list[int]] = {v: [] for v in VARIANTS}
    problem: Exception | None = None
    for budget in resolved:
        for v in VARIANTS:
            try:
                pools[v].append(engine_pool_blocks(budget, resident[v], reserve, block_bytes))
            except WshardingError as e:
                problem = problem or InvalidArgument(f"rank {ctx.rank}, the {v} model: {e}")
    if problem is not None:  # every rank sizes alike: each refuses the same budget
        raise problem
    longest = -(-max_context // page_size)
    if longest > min(min(p) for p in pools.values()):
        # a request that never fits would wait in the engine's queue for ever
        raise InvalidArgument(f"rank {ctx.rank}: the workload's longest request needs {longest} blocks of {page_size} "
                              f"tokens, the smallest pool has {min(min(p) for p in pools.values())}: give a larger "
                              "budget or shorter requests")
    runs: dict[str, dict[str, Any]] = {v: {} for v in VARIANTS}
    differ: dict[str, list[int]] = {}
    own_differ: dict[str, list[int]] = {}
    for b in range(len(resolved)):
        for ri, rate in enumerate(rates):
            for t in range(trials):
                wl = base.with_(rate=math.inf if rate is None else rate, seed=base.seed * 1000 + t)
                requests = wl.for_rank(ctx.rank, config.vocab_size)
                order = VARIANTS if t % 2 == 0 else VARIANTS[::-1]
                for v in order:
                    model, c = models[v]
                    cfgs = engine_configs(max(r.output for r in requests), pools[v][b], page_size, max_batch_tokens,
                                          max_requests)
                    run = serve_once(ctx, model, c, requests, cfgs, num_blocks=pools[v][b], block_bytes=block_bytes)
                    run.update(first=v == order[0], realised_rate=realised_rate(requests), pool_blocks=pools[v][b])
                    runs[v][f"{b}/{ri}/{t}"] = run
                    gc.collect()
                if t == 0:
                    key = f"{b}/{ri}"
                    a, s = runs["replicated"][f"{key}/0"]["tokens"], runs["sharded"][f"{key}/0"]["tokens"]
                    own_differ[key] = sorted(rid for rid in a if a[rid] != s[rid])
                    if check:
                        differ[key] = _token_check(ctx, models, requests, pools["replicated"][b], page_size,
                                                   max_batch_tokens, max_requests, block_bytes)
    for run_set in runs.values():
        for run in run_set.values():
            run["tokens"] = {str(k): v for k, v in run["tokens"].items()}  # JSON keys
    ws.close()
    return {"rank": ctx.rank, "emulation": ctx.emulation if device.type != "cuda" else ws.comm.emulation,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world_size": ctx.world_size, "ranks_per_device": share, "communicator": type(ws.comm).__name__,
            "model": model_name, "layers": config.num_hidden_layers, "dtype": str(dtype).removeprefix("torch."),
            "budget_specs": budgets, "budgets": resolved, "rates": rates, "trials": trials, "pools": pools,
            "page_size": page_size, "block_bytes": block_bytes, "max_batch_tokens": max_batch_tokens,
            "max_requests": max_requests, "max_context": max_context,
            "sizing": {v: {"resident_bytes": resident[v], "reserve_bytes": reserve} for v in VARIANTS},
            "runs": runs, "differ": differ, "own_differ": own_differ, "checked": check,
            "workload": base.as_dict(), "workload_text": base.describe()}


def _token_check(ctx: RankContext, models: dict[str, Any], requests: list[Request], num_blocks: int, page_size: int,
                 max_batch_tokens: int, max_requests: int, block_bytes: int) -> list[int]:
    """[Note: the engine's token check]: both variants, the replicated pool, every request queued before
    the engine starts; the requests whose tokens differ."""
    got = {}
    for v in VARIANTS:
        model, c = models[v]
        cfgs = engine_configs(max(r.output for r in requests), num_blocks, page_size, max_batch_tokens, max_requests)
        got[v] = serve_once(ctx, model, c, requests, cfgs, num_blocks=num_blocks, block_bytes=block_bytes,
                            queued=True)["tokens"]
    return sorted(rid for rid in got["replicated"] if got["replicated"][rid] != got["sharded"][rid])
