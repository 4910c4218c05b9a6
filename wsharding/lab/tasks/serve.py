"""Rank task of ``wsharding bench serve``: the same requests served by the replicated and the sharded
model under the same memory budget, at a sweep of request rates, each point repeated.

Every variant is built once, up front, and serves every (budget, rate, trial) point; at each point
the variants serve the **same arrivals** one after the other, interleaved per trial (which goes first
alternates from trial to trial, so a machine that slows down over a run does not always cost the same
variant). Each variant's KV pool is the budget less what *it* holds
(:func:`wsharding.serve.budget.pool_blocks`). Replicated ranks run **free** -- a barrier before and
after, no per-step agreement, no idle steps, each stops when its own work is done -- as replicas of
a replicated deployment do; sharded ranks run **aligned** steps (their gathers pair up; a rank pads
while a peer computes, none steps while no rank has work: :func:`_earliest`), and their idle steps
are counted. The replicated run of each point's first trial records when it scheduled
each step; each sharded model then replays those steps with the replicated pool's size, padded with
idle steps to the longest rank's schedule (every rank replays its own) -- the same steps, so every
token must be equal ([Note: bits across buckets] in :mod:`wsharding.serve.step`).

Steps as a server runs them (``graphs``): each variant keeps **one pool per budget**, reused by every
trial and rate there and reset before each (:meth:`~wsharding.serve.blocks.BlockPool.reset`: a trial
sees no earlier trial's K/V or block table), with a :class:`~wsharding.serve.runner.StepRunner` on it.
Where the pair can be captured (:func:`~wsharding.serve.runner.pair_eager_reason`), a first trial at
each budget runs every step eagerly, unmeasured (a **warm-up trial**): the decode-only shapes it met,
merged over ranks and variants (:func:`~wsharding.serve.runner.shapes_of_every_rank`), are captured on
every variant's pool before the measured trials, which replay them and run any other step eagerly,
both counted. Where it cannot, both variants run every step eagerly and the result says why, once.
"""

from __future__ import annotations

import gc
import statistics
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.core.observe import observing
from wsharding.core.sharding import WeightSharding
from wsharding.costmodel.bill import bill_for_layouts
from wsharding.lab.progress import rank_stage
from wsharding.lab.tasks.loading import FinalizeStages, outside_allocator_bytes
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
from wsharding.serve import (
    BlockPool,
    Workload,
    activation_reserve_bytes,
    pool_blocks,
    serve,
)
from wsharding.serve.budget import resolve_budget
from wsharding.serve.engine import ServeRun
from wsharding.serve.runner import StepRunner, pair_eager_reason, shapes_of_every_rank
from wsharding.serve.scheduler import check_servable
from wsharding.serve.step import build_step, context_buckets, token_buckets
from wsharding.serve.workload import realised_rate

#: The variants every run serves; with ``plain`` and where the sharded one maps its own chunk (our
#: NCCL, >= 2.30), a third with plain slots shows what the mapping adds.
VARIANTS = ("replicated", "sharded")
PLAIN = "sharded_plain"


def _reduced(ctx: RankContext, value: int | float, op: dist.ReduceOp) -> int | float:
    """``value`` reduced over every rank (every rank calls it), on the device the process group uses;
    an int as int64, a float as float64 (so +inf survives the reduction)."""
    if ctx.world_size == 1:
        return value
    dtype = torch.float64 if isinstance(value, float) else torch.int64
    t = torch.tensor([value], dtype=dtype, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=op)
    return t.item()


def _any_rank(ctx: RankContext, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank."""
    return bool(_reduced(ctx, int(flag), dist.ReduceOp.MAX))


def _earliest(ctx: RankContext, ready_at: float) -> float:
    """The minimum of ``ready_at`` over every rank (every rank calls it before every aligned step): when
    the earliest rank has something to compute; +inf: nothing left on any rank."""
    return float(_reduced(ctx, float(ready_at), dist.ReduceOp.MIN))


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
            with observing(ws.observers, FinalizeStages(lambda stage, layer: meter.sample())):
                ws.finalize()
    peak = meter.result
    return model, ws, {"load_peak_bytes": peak.device_peak_bytes, "load_peak_is_host": peak.device_is_host}


def layer_times(model: ToyDecoder, ws: WeightSharding, tokens: int, width: int, steps: int) -> list[dict[str, Any]]:
    """Per sharded layer, the median gather and compute time (µs) of ``steps`` traced padding steps of
    ``tokens`` rows attending over ``width`` (a shape the run used: its cost is its shape's)."""
    pool = BlockPool.for_model(model, 1)
    idle = build_step(pool, [], [tokens], [width])
    planner = ws.planner
    planner.trace_enabled = True
    traces = []
    try:
        with torch.no_grad():
            for _ in range(steps):
                model.forward_serve(idle.step).argmax(-1).tolist()
                traces.append(planner.finish_step())
    finally:
        planner.trace_enabled = False
        planner.traces.clear()
    out = []
    for layer in sorted(ws.layouts):
        marks = [t.layers.get(layer, {}) for t in traces]
        gather = [m["gather_end"] - m["gather_start"] for m in marks if "gather_end" in m and "gather_start" in m]
        compute = [m["compute_end"] - m["compute_start"] for m in marks if "compute_end" in m]
        out.append({"layer": layer, "tokens": tokens, "width": width, "layout_bytes": ws.layouts[layer].total_bytes,
                    "payload_bytes": ws.layouts[layer].payload_bytes,
                    "gather_us": statistics.median(gather) if gather else None,
                    "compute_us": statistics.median(compute) if compute else None})
    return out


#: Samples of the KV blocks in use kept per run (a run's steps binned, the most used in each bin).
KV_SAMPLES = 128


def kv_trace(times: list[float], blocks: list[int], samples: int = KV_SAMPLES) -> dict[str, list]:
    """KV blocks in use over a run, compact: per step when there are at most ``samples`` steps, else
    the steps cut into ``samples`` bins of consecutive steps, each the time of its first step and the
    most blocks any of its steps used (so the peak is kept)."""
    if len(blocks) <= samples:
        return {"t": [round(x, 4) for x in times], "blocks": list(blocks)}
    edges = [len(blocks) * i // samples for i in range(samples + 1)]
    return {"t": [round(times[a], 4) for a in edges[:-1]],
            "blocks": [max(blocks[a:b]) for a, b in zip(edges, edges[1:], strict=False)]}


def _summary(run: ServeRun, pool: BlockPool, requests: list[Any], first: bool,
             steps: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """What the report keeps of one run: counts, per-bucket step times, KV blocks over time, the
    per-request records. ``first``: whether this variant went first at its point; ``steps``: its
    steps replayed from CUDA graphs and run eagerly."""
    by_bucket: dict[int, list[float]] = {}
    for b, s, n in zip(run.step_bucket, run.step_s, run.step_tokens, strict=True):
        c = by_bucket.setdefault(b, [0, 0.0, 0, 0])
        c[0] += 1
        c[1] += s
        c[2] += n
        c[3] += n > 0
    working = [n for n in run.step_requests if n]
    return {"pool_blocks": pool.blocks, "pool_tokens": pool.tokens, "pool_bytes": pool.nbytes,
            "peak_blocks": run.peak_blocks, "preemptions": run.preemptions,
            "recomputed_tokens": run.recomputed_tokens, "waited_for_memory": run.waited_for_memory,
            "peak_in_flight": run.peak_in_flight, "idle_steps": run.idle_steps, "first": first,
            "realised_rate": realised_rate(requests),
            "steps": run.steps, "wall_s": run.wall_s, "max_concurrency": max(run.step_requests, default=0),
            "mean_concurrency": statistics.fmean(working) if working else 0.0,
            "tokens_per_step": statistics.fmean(n for n in run.step_tokens if n) if any(run.step_tokens) else 0.0,
            "steps_by_bucket": {str(b): {"steps": c[0], "seconds": c[1], "tokens": c[2], "working": c[3]} for b, c in sorted(by_bucket.items())},
            "contexts": dict(Counter(w for w, n in zip(run.step_context, run.step_tokens, strict=True) if n)),
            "kv_blocks": kv_trace(run.schedule_times, run.step_blocks),
            "graphed_steps": steps[0], "eager_steps": steps[1], "records": run.records}


def _summed(ctx: RankContext, counts: list[int]) -> list[int]:
    """``counts`` summed over every rank (every rank calls it)."""
    if ctx.world_size == 1:
        return counts
    t = torch.tensor(counts, dtype=torch.int64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def _probe_shapes(ctx: RankContext, summaries: Any, token_budget: int, max_context: int) -> tuple[list[int], int]:
    """The shapes to time per layer, the same on every rank (each runs the probe's gathers): the token
    bucket most working steps used and the largest any used, at the context bucket most used, counted
    over every rank's runs."""
    sizes, widths = token_buckets(token_budget), context_buckets(max_context)
    steps, contexts = [0] * len(sizes), [0] * len(widths)
    for s in summaries:
        for k, c in s["steps_by_bucket"].items():
            steps[sizes.index(int(k))] += c["working"]  # idle padding steps are not a batch size served
        for w, c in s["contexts"].items():
            contexts[widths.index(w)] += c
    steps, contexts = _summed(ctx, steps), _summed(ctx, contexts)
    used = [n for n, c in zip(sizes, steps, strict=True) if c]
    if not used:
        return [token_budget], max_context
    common = max(zip(steps, sizes, strict=True))[1]
    return sorted({common, used[-1]}), max(zip(contexts, widths, strict=True))[1]


def serve_rank(ctx: RankContext, preset: str, *, workload: dict[str, Any], budgets: list[dict[str, Any]],
               rates: list[float | None], trials: int = 3, token_budget: int = 64, max_seqs: int | None = None,
               max_concurrency: int | None = None, comm: str = "torch", layers: int | None = None, seed: int = 0,
               reserve_bytes: int | None = None, plain: bool = False, probe_steps: int = 3,
               check: bool = True, graphs: str = "auto", progress: str | None = None) -> dict[str, Any]:
    """Serve this rank's requests with each variant under each budget, at each rate (None: all at
    once), ``trials`` times with other seeds; the variants built once and interleaved per point.

    Returns per variant, budget, rate and trial the run's summary and per-request records; the
    sizing of each variant; per sharded layer the gather and compute times at the shapes the run
    used most and at its largest; and, per (budget, rate), the requests whose tokens differ between
    the replicated run and the sharded model's replay of it (``differ``, which must be empty) and
    between the replicated run and the sharded model's own run (``own_differ``, informative).
    ``graphs``: ``auto``, ``on`` or ``off`` (:data:`~wsharding.serve.runner.GRAPH_MODES`); the result's
    ``graphs`` holds why both variants ran eagerly (or None) and, per budget and variant, the shapes
    captured and the seconds the captures took. ``progress``: the command's name; rank 0 then tells each build and each run on standard error.
    """
    cfg = decoder_config(preset, layers)
    comm_ = shard_comm_for(ctx, comm)
    # decided before anything is built: every rank's communicator answers alike, so --graphs on that
    # cannot be kept is refused on every rank at once, and a pair never runs half graphed
    eager_reason = pair_eager_reason(graphs, comm_)
    device = comm_.device
    share = ranks_sharing_device(ctx.world_size, device)
    base = Workload.from_dict(workload)
    max_context = context_buckets(base.max_len)[-1]
    points = [(b, ri, t) for b in range(len(budgets)) for ri in range(len(rates)) for t in range(trials)]

    def workload_at(ri: int, t: int) -> Workload:
        rate = rates[ri]
        return base.with_(rate=float("inf") if rate is None else rate, seed=base.seed * 1000 + t)

    runs: dict[str, dict[str, Any]] = {}
    outputs: dict[str, dict[tuple[int, int, int], dict[int, list[int]]]] = {}
    replays: dict[tuple[int, int], dict[str, Any]] = {}
    sizing: dict[str, dict[str, Any]] = {}
    resolved: list[int] = []
    built: dict[str, tuple[ToyDecoder, WeightSharding | None]] = {}
    variants = list(VARIANTS)
    for variant in variants:  # grows by PLAIN when asked and the sharded variant maps its own chunk
        rank_stage(ctx.rank, progress, f"building {preset} {variant}")
        model, ws, load = _build(variant, cfg, comm_, seed)
        built[variant] = (model, ws)
        if variant == "sharded" and plain and ws.map_own_chunk:
            variants.append(PLAIN)
        resident = model_bytes(model) if ws is None else sharded_model_bytes(model, ws)
        reserve = activation_reserve_bytes(model, token_budget, max_context) if reserve_bytes is None else reserve_bytes
        sizing[variant] = {"resident_bytes": resident, "reserve_bytes": reserve, **load}
        if variant == "replicated":
            resolved = [resolve_budget(s, resident, reserve, device, share) for s in budgets]
        if ws is not None:
            bill = bill_for_layouts(list(ws.layouts.values()), ranks=comm_.world_size, map_own_chunk=ws.map_own_chunk,
                                    granularity=comm_.alloc_granularity)
            sizing[variant].update({"net_saving_bytes_predicted": bill.net_saving_bytes,
                                    "map_own_chunk": ws.map_own_chunk, "slot_layout": ws.map_own_chunk_reason})
        runs[variant] = {}
        outputs[variant] = {}
    per_token = kv_bytes_per_token(built["replicated"][0])

    def sized_pool(variant: str, b: int, requests: list[Any], blocks: int | None = None) -> BlockPool:
        """The variant's pool at budget ``b`` (or of ``blocks``), refused on every rank when any rank's is."""
        model = built[variant][0]
        problem, pool = None, None
        try:
            if blocks is None:
                blocks = pool_blocks(resolved[b], sizing[variant]["resident_bytes"], sizing[variant]["reserve_bytes"],
                                     per_token)
            if device.type == "cuda":
                room = kv_budget_bytes(device, share=share)[0]
                if (blocks + 1) * 16 * per_token > room:
                    raise InvalidArgument(
                        f"rank {ctx.rank}: a budget of {resolved[b] / 2**30:.2f} GiB asks for a KV pool of "
                        f"{(blocks + 1) * 16 * per_token / 2**30:.2f} GiB, but only {room / 2**30:.2f} GiB is free "
                        "for this rank on its GPU (every variant's model and its pools at this budget are "
                        "resident): give a smaller budget")
            pool = BlockPool.for_model(model, blocks)
            check_servable(requests, pool, max_context)
        except WshardingError as e:
            problem = e
        _all_ranks_ready(ctx, problem)
        return pool

    def servable(pool: BlockPool, requests: list[Any]) -> None:
        """A reused pool checked for this trial's requests, refused on every rank when any rank's is."""
        problem = None
        try:
            check_servable(requests, pool, max_context)
        except WshardingError as e:
            problem = e
        _all_ranks_ready(ctx, problem)

    # one runner (and its pool) per (variant, budget, "run" or "replay"), kept for every point at that budget
    runners: dict[tuple[str, int, str], StepRunner] = {}
    shapes_at: dict[int, list[Any]] = {}
    # per budget and variant: pools made (one for its runs, one for a sharded variant's replay) and runs
    # served on a pool reset, the shapes captured on its run pool and their seconds, the replay's steps
    graph_info: list[dict[str, dict[str, Any]]] = [
        {v: {"pools": 0, "resets": 0, "shapes": 0, "capture_s": 0.0, "replay_graphed_steps": 0,
             "replay_eager_steps": 0}
         for v in variants} for _ in budgets]

    def runner_for(variant: str, b: int, requests: list[Any], replay_blocks: int | None = None) -> StepRunner:
        """The variant's runner at budget ``b``, its pool reset (a fresh pool's blocks, K/V zeroed);
        made, and given the budget's graphs, the first time. Collective (pool checks, captures)."""
        key = (variant, b, "run" if replay_blocks is None else "replay")
        runner = runners.get(key)
        if runner is None:
            pool = sized_pool(variant, b, requests, blocks=replay_blocks)
            runner = runners[key] = StepRunner(built[variant][0], pool, graphs=eager_reason is None)
            graph_info[b][variant]["pools"] += 1
            if b in shapes_at:
                runner.capture(shapes_at[b])
        else:
            servable(runner.pool, requests)
            runner.pool.reset()
            graph_info[b][variant]["resets"] += 1
        return runner

    warmed: set[str] = set()

    def serve_on(variant: str, runner: StepRunner, requests: list[Any], warmup: int | None = None,
                 **replay: Any) -> tuple[ServeRun, tuple[int, int]]:
        """One run of ``variant`` through ``runner``; its steps replayed and run eagerly. ``warmup``: None,
        one round of warm-up steps in this variant's first run only."""
        before = (runner.graphed_steps, runner.eager_steps)
        # serve's warm-up (a padding step of every token bucket, untimed) pays each shape's first-forward costs in
        # this process: once per variant's model. A later run (another budget or rate: another pool, the same
        # shapes) has none left to pay, and its warm-up steps -- gathers included -- were CPU time for nothing.
        if warmup is None:
            warmup = 0 if variant in warmed else 1
        if warmup:
            warmed.add(variant)
        align_ranks(ctx)
        if variant == "replicated" and not replay:  # free: no lockstep, no idle steps; a barrier after
            run = serve(built[variant][0], runner.pool, requests, token_budget=token_budget, max_context=max_context,
                        max_seqs=max_seqs, max_concurrency=max_concurrency, runner=runner, warmup=warmup)
            align_ranks(ctx)
        else:
            run = serve(built[variant][0], runner.pool, requests, token_budget=token_budget, max_context=max_context,
                        max_seqs=max_seqs, max_concurrency=max_concurrency, runner=runner, warmup=warmup, **replay,
                        agree=None if replay else lambda ready_at: _earliest(ctx, ready_at))
        return run, (runner.graphed_steps - before[0], runner.eager_steps - before[1])

    def close_budget(b: int) -> None:
        """Drop budget ``b``'s runners and pools (graphs before the communicator: NCCL's destroy waits for them)."""
        for key in [k for k in runners if k[1] == b]:
            runners.pop(key).close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    for b, ri, t in points:
        rate = "all at once" if rates[ri] is None else f"{rates[ri]:g}/s"
        requests = workload_at(ri, t).for_rank(ctx.rank, cfg.vocab)
        if ri == 0 and t == 0 and b > 0:
            close_budget(b - 1)
        if ri == 0 and t == 0 and eager_reason is None:
            # the warm-up trial: every step eager, unmeasured; the decode shapes any rank met, captured for all
            met: list[Any] = []
            for variant in variants:
                rank_stage(ctx.rank, progress, f"{variant}: budget {b + 1} of {len(budgets)}, warm-up trial "
                                               "(eager; its decode shapes are captured)")
                runner = runner_for(variant, b, requests)
                serve_on(variant, runner, requests)
                met += list(runner.missed)
            shapes_at[b] = shapes_of_every_rank(met)
            rank_stage(ctx.rank, progress, f"capturing {len(shapes_at[b])} step shapes per variant")
            for variant in variants:
                runners[(variant, b, "run")].capture(shapes_at[b])
        order = variants if t % 2 == 0 else variants[::-1]  # which goes first alternates per trial
        for variant in order:
            rank_stage(ctx.rank, progress, f"{variant}: budget {b + 1} of {len(budgets)}, rate {rate}, trial "
                                           f"{t + 1} of {trials}")
            runner = runner_for(variant, b, requests)
            run, steps = serve_on(variant, runner, requests)
            runs[variant][f"{b}/{ri}/{t}"] = _summary(run, runner.pool, requests, first=variant == order[0],
                                                      steps=steps)
            outputs[variant][(b, ri, t)] = run.outputs
            if variant == "replicated" and t == 0:
                replays[(b, ri)] = {"times": run.schedule_times, "blocks": runner.pool.blocks}
            graph_info[b][variant].update(shapes=len(runner.captured), capture_s=runner.capture_s)
        if t == 0 and check:
            # [Note: bits across buckets]: the replicated run's steps, on each sharded model, token for token;
            # the ranks' free schedules differ in length, so each replay is padded to the longest with idle steps
            rep = replays[(b, ri)]
            longest = _reduced(ctx, len(rep["times"]), dist.ReduceOp.MAX)
            for variant in variants[1:]:
                rank_stage(ctx.rank, progress, f"{variant}: replaying the replicated run's steps (token check)")
                runner = runner_for(variant, b, requests, replay_blocks=rep["blocks"])
                # no warm-up steps: the replay is timed by nobody (only its tokens are read), and this model
                # has served this point already
                again, steps = serve_on(variant, runner, requests, schedule_times=rep["times"], pad_to=longest,
                                        warmup=0)
                rep.setdefault("outputs", {})[variant] = again.outputs
                graph_info[b][variant]["replay_graphed_steps"] += steps[0]
                graph_info[b][variant]["replay_eager_steps"] += steps[1]
    if budgets:
        close_budget(len(budgets) - 1)
    probes: list[dict[str, Any]] = []
    model, ws = built["sharded"]
    shapes, width = _probe_shapes(ctx, runs["sharded"].values(), token_budget, max_context)
    probes = [lt for n in shapes for lt in layer_times(model, ws, n, width, probe_steps)]
    for variant in variants:
        if built[variant][1] is not None:
            built[variant][1].close()
    built.clear()
    del model, ws
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    differ, own_differ = {}, {}
    for (b, ri), rep in replays.items():
        want = outputs["replicated"][(b, ri, 0)]
        differ[f"{b}/{ri}"] = sorted({rid for v, got in rep.get("outputs", {}).items() for rid in want
                                      if got.get(rid) != want[rid]})
        own_differ[f"{b}/{ri}"] = sorted({rid for v in variants[1:] for rid in want
                                          if outputs[v][(b, ri, 0)].get(rid) != want[rid]})
    # ranks sharing a GPU meet over gloo (a CPU context) but serve on the GPU: the communicator says what is emulated
    emulation = comm_.emulation if device.type == "cuda" else ctx.emulation
    return {"rank": ctx.rank, "mode": comm_.mode, "emulation": emulation,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "device_memory_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
            "communicator": type(comm_).__name__, "world_size": ctx.world_size, "ranks_per_device": share,
            "kv_bytes_per_token": per_token, "dtype": str(cfg.torch_dtype).removeprefix("torch."),
            "budget_specs": budgets, "budgets": resolved, "rates": rates, "trials": trials, "sizing": sizing,
            "runs": runs, "graphs": {"mode": graphs, "eager_reason": eager_reason, "by_budget": graph_info},
            "differ": differ, "own_differ": own_differ, "checked": check, "layer_times": probes,
            "workload": base.as_dict(), "workload_text": base.describe(), "token_budget": token_budget,
            "max_seqs": max_seqs, "max_concurrency": max_concurrency, "max_context": max_context, "preset": preset,
            "layers": cfg.layers}
