"""Rank tasks for a real serving engine: a tiny Llama, sharded, served by transformers' continuous
batching on every rank with loads that differ (:mod:`wsharding.engines.transformers_cb`), against
the replicated model served by the same engine (tests, ``examples/serve_transformers.py``, notebook 07).

They live in the package because spawned ranks import tasks by name.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.errors import WshardingError
from wsharding.core.runner import shard_blocks
from wsharding.core.torch_backend import TorchDistComm
from wsharding.engines.transformers_cb import AlignedEngine, EngineError, generate
from wsharding.lab.tasks.loading import HF_LLAMA_PATTERNS, build_llama, tiny_llama_config
from wsharding.serve.workload import Workload


def engine_configs(max_new_tokens: int, compile_level: int = 0, num_blocks: int | None = 32, page_size: int = 16,
                   max_batch_tokens: int | None = 64) -> tuple[Any, Any]:
    """A greedy ``GenerationConfig`` and a ``ContinuousBatchingConfig`` of fixed sizes (the same on every
    rank and for the replicated twin, so that both engines batch alike); ``num_blocks`` / ``max_batch_tokens``
    None: the engine sizes its KV pool from the memory left (sharded, more is left)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=8, default_compile_level=compile_level,
                                  use_cuda_graph=False, use_async_batching=False)
    return gen, cb


def prompts_for(rank: int, count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of this rank (3 to 9 tokens), seeded by the rank."""
    g = torch.Generator().manual_seed(104_729 * seed + 7919 * rank + 1)
    return [torch.randint(0, vocab, (int(torch.randint(3, 10, (), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def sharded_llama(ctx: RankContext, *, seed: int = 0, layers: int = 2, group_size: int | None = None,
                  gather_timeout_s: float | None = None, **shard_kwargs: Any) -> tuple[Any, Any, Any]:
    """The tiny Llama (random weights from ``seed``, no download) twice on this rank: the replicated
    reference and a copy with its attention and MLP projections sharded over the group. Returns
    ``(reference, sharded, ws)``. ``gather_timeout_s``: the gathers on a group of their own with that
    collective timeout (a run that shows a hang ends in seconds)."""
    if gather_timeout_s is None:
        comm = shard_comm_for(ctx, "torch", group_size)
    else:
        import torch.distributed as dist

        timeout = timedelta(seconds=gather_timeout_s)
        comm = TorchDistComm(dist.new_group(list(range(ctx.world_size)), timeout=timeout), timeout=timeout)
    config = tiny_llama_config(num_hidden_layers=layers)
    reference = build_llama(config, seed).to(ctx.device)
    model = build_llama(config, seed).to(ctx.device)
    ws = shard_blocks(model, "model.layers", list(HF_LLAMA_PATTERNS), comm, **shard_kwargs)
    return reference, model, ws


def replicated_tokens(reference: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      compile_level: int = 0) -> list[list[int]]:
    """The replicated model's tokens for ``prompts``, served by the engine's own ``generate_batch``."""
    if not prompts:
        return []
    gen, cb = engine_configs(max_new_tokens, compile_level)
    out = reference.generate_batch([list(p) for p in prompts], generation_config=gen, continuous_batching_config=cb)
    if any(o.error for o in out.values()):
        raise EngineError(f"the replicated engine failed: {[o.error for o in out.values() if o.error][:1]}")
    return [o.generated_tokens for o in out.values()]


def engine_equal(ctx: RankContext, counts: Sequence[int], new_tokens: Sequence[int], *, compile_level: int = 0,
                 arrivals_s: Sequence[float] | None = None, seed: int = 0) -> dict[str, Any]:
    """Serve ``counts[rank]`` prompts of ``new_tokens[rank]`` new tokens on this rank through the aligned
    engine (all at once, or added at ``arrivals_s`` seconds through ``add_request``), and the same prompts
    through the replicated engine; compare every request's tokens.

    Returns this rank's tokens, whether each equals the replicated engine's, and the round counters."""
    reference, model, ws = sharded_llama(ctx, seed=seed)
    vocab = reference.config.vocab_size
    prompts = prompts_for(ctx.rank, counts[ctx.rank], vocab, seed)
    n = new_tokens[ctx.rank]
    gen, cb = engine_configs(n, compile_level)
    if arrivals_s is None:
        outputs, engine = generate(model, ws.comm, prompts, max_new_tokens=n, generation_config=gen, cb_config=cb)
        tokens = [o.generated_tokens for o in outputs.values()]
    else:
        engine = AlignedEngine(model, ws.comm, generation_config=gen, cb_config=cb)
        with engine:
            t0 = time.perf_counter()
            ids = []
            for p, at in zip(prompts, arrivals_s, strict=False):
                time.sleep(max(0.0, t0 + at - time.perf_counter()))
                ids.append(engine.add_request(p, max_new_tokens=n))
            tokens = [o.generated_tokens for o in engine.results(ids).values()]
    expected = replicated_tokens(reference, prompts, n, compile_level)
    return {"rank": ctx.rank, "emulation": ctx.emulation, "tokens": tokens, "expected": expected,
            "equal": [a == b for a, b in zip(tokens, expected, strict=True)] if len(tokens) == len(expected) else None,
            "counters": engine.counters.as_dict(), "gathers_total": ws.planner.gathers_total,
            "sharded_layers": ws.sharded_layer_ids}


def engine_unaligned(ctx: RankContext, counts: Sequence[int] = (3, 1), new_tokens: Sequence[int] = (10, 4),
                     gather_timeout_s: float = 2.0) -> dict[str, Any]:
    """What the adapter prevents: transformers' own ``generate_batch`` on the sharded model, loads that
    differ. The busier rank's forward after its peer finished waits in a gather nobody joins until the
    collective timeout; the engine marks its requests failed and returns them as results, no error."""
    reference, model, ws = sharded_llama(ctx, gather_timeout_s=gather_timeout_s)
    prompts = prompts_for(ctx.rank, counts[ctx.rank], reference.config.vocab_size)
    gen, cb = engine_configs(new_tokens[ctx.rank])
    outputs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    return {"rank": ctx.rank, "tokens": [o.generated_tokens for o in outputs.values()],
            "errors": [o.error for o in outputs.values()]}


class InjectedFault(WshardingError, RuntimeError):
    """The fault :class:`FailAt` raises: a rank's forward failing on purpose."""


class FailAt:
    """A forward pre-hook that raises in the ``at``-th forward of the block it is on (a fault injected
    on one rank)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, _mod: Any, _args: Any) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise InjectedFault(f"fault injected in forward {self.at}")


def engine_failure(ctx: RankContext, fail_rank: int, at_forward: int = 3, counts: Sequence[int] = (2, 2),
                   new_tokens: int = 6) -> dict[str, Any]:
    """One rank's engine fails in its ``at_forward``-th forward of the first decoder layer: every rank's
    :func:`~wsharding.engines.transformers_cb.generate` must raise, none return tokens."""
    reference, model, ws = sharded_llama(ctx)
    if ctx.rank == fail_rank:
        model.model.layers[0].register_forward_pre_hook(FailAt(at_forward))
    prompts = prompts_for(ctx.rank, counts[ctx.rank], reference.config.vocab_size)
    gen, cb = engine_configs(new_tokens)
    try:
        outputs, _ = generate(model, ws.comm, prompts, max_new_tokens=new_tokens, generation_config=gen, cb_config=cb)
    except EngineError as e:
        return {"rank": ctx.rank, "raised": type(e).__name__, "message": str(e), "outputs": None}
    return {"rank": ctx.rank, "raised": None, "message": "",
            "outputs": {k: v.generated_tokens for k, v in outputs.items()}}


def engine_serve(ctx: RankContext, workload: Workload, *, sharded: bool = True, compile_level: int = 0,
                 num_blocks: int | None = 32, page_size: int = 16, max_batch_tokens: int | None = 64,
                 layers: int = 2) -> dict[str, Any]:
    """Serve this rank's requests of ``workload`` (arrivals at their times, through ``add_request``) with
    transformers' engine, on the sharded model (aligned) or on the replicated one (each rank alone), and
    record what a user sees, in the fields of :func:`wsharding.serve.metrics.trial_metrics`: per request
    ``rid, rank, arrival_s, sent_s, token_s, prompt_tokens, output_tokens, preempted`` (seconds since the
    run's start; ``token_s`` from the engine's own per-token timestamps)."""
    reference, model, ws = sharded_llama(ctx, layers=layers)
    requests = workload.for_rank(ctx.rank, reference.config.vocab_size)
    gen, cb = engine_configs(max(r.output for r in requests), compile_level, num_blocks, page_size, max_batch_tokens)
    if sharded:
        engine: Any = AlignedEngine(model, ws.comm, generation_config=gen, cb_config=cb)
        manager = engine.manager
    else:
        engine = None
        manager = reference.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    ids: list[str] = []
    if engine is not None:
        engine.start()
    else:
        manager.warmup()
        manager.start()
    t0 = time.perf_counter()
    try:
        for r in requests:
            time.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
            rid = f"r{r.rid}"
            if engine is not None:
                engine.add_request(r.prompt, max_new_tokens=r.output, request_id=rid, record_timestamps=True)
            else:
                manager.add_request(list(r.prompt), request_id=rid, max_new_tokens=r.output, record_timestamps=True)
            ids.append(rid)
        if engine is not None:
            outputs = engine.results(ids)
        else:
            outputs = {}
            while len(outputs) < len(ids):
                out = manager.get_result(timeout=1.0)
                if out is None and not manager.is_running():
                    raise EngineError(f"rank {ctx.rank}: the replicated engine stopped")
                if out is not None and out.error is not None:
                    raise EngineError(f"rank {ctx.rank}: request {out.request_id} failed: {out.error}")
                if out is not None and out.is_finished():
                    outputs[out.request_id] = out
    finally:
        if engine is not None:
            engine.stop()
        elif manager.is_running():
            manager.stop(block=True)
    preempted = engine.preemptions if engine is not None else {}
    records = []
    for r in requests:
        o = outputs[f"r{r.rid}"]
        records.append({"rid": r.rid, "rank": ctx.rank, "arrival_s": r.arrival_s, "sent_s": o.created_time - t0,
                        "token_s": [t - t0 for t in o.timestamps], "prompt_tokens": len(r.prompt),
                        "output_tokens": len(o.generated_tokens), "preempted": preempted.get(f"r{r.rid}", 0)})
    resolved = manager.continuous_batching_config
    return {"rank": ctx.rank, "variant": "sharded" if sharded else "replicated", "emulation": ctx.emulation,
            "records": records, "tokens": {f"r{r.rid}": outputs[f"r{r.rid}"].generated_tokens for r in requests},
            "num_blocks": resolved.num_blocks, "page_size": resolved.page_size,
            "counters": engine.counters.as_dict() if engine is not None else None}


def run_engine_trial(cluster: Any, workload: Workload, slo: Any = None, *, warmup: int = 0,
                     **serve_kwargs: Any) -> dict[str, Any]:
    """The same workload served by transformers' engine twice on ``cluster``'s ranks -- the sharded model
    (aligned) and the replicated one -- with :func:`~wsharding.serve.metrics.trial_metrics` of each (the
    fields the package's own scheduler reports), whether every request's tokens are equal, and the sharded
    run's round counters per rank. A tiny Llama on CPU ranks runs in a few seconds (emulated: say so)."""
    from wsharding.serve.metrics import trial_metrics

    runs = {v: cluster.run(engine_serve, workload, sharded=v == "sharded", **serve_kwargs)
            for v in ("sharded", "replicated")}
    ranks = len(runs["sharded"])
    out: dict[str, Any] = {"ranks": ranks, "emulation": runs["sharded"][0]["emulation"],
                           "workload": workload.describe(), "tokens_equal": all(
                               s["tokens"] == r["tokens"] for s, r in zip(runs["sharded"], runs["replicated"],
                                                                          strict=True)),
                           "counters": [r["counters"] for r in runs["sharded"]]}
    for variant, results in runs.items():
        records = [rec for r in results for rec in r["records"]]
        out[variant] = {"metrics": trial_metrics(records, ranks, warmup, slo), "records": records,
                        "num_blocks": [r["num_blocks"] for r in results], "page_size": results[0]["page_size"]}
    return out


def agreement_cost(ctx: RankContext, rounds: int = 200) -> dict[str, Any]:
    """The per-round agreement alone ([Note: one agreement per engine round] in
    :mod:`wsharding.engines.transformers_cb`): ``rounds`` all-reduces back to back after a barrier, so that
    no peer is late; microseconds per round (host clock), the median of 5 batches of ``rounds // 5``."""
    import statistics

    import torch.distributed as dist

    from wsharding.engines.transformers_cb import StepAgreement

    agreement = StepAgreement(shard_comm_for(ctx, "torch"))
    per = max(1, rounds // 5)
    batches = []
    for _ in range(5):
        dist.barrier(agreement.group)
        t = time.perf_counter()
        for _ in range(per):
            agreement.reduce(False, True, False)
        batches.append((time.perf_counter() - t) / per * 1e6)
    return {"rank": ctx.rank, "us_per_round": statistics.median(batches), "emulation": ctx.emulation}


def compile_counts(ctx: RankContext, layers: int = 4, backend: str = "aot_eager", lengths: Sequence[int] = (5, 3, 7),
                   graph_ops: bool = True, explain_only: bool = False) -> dict[str, Any]:
    """torch.compile on the sharded tiny Llama against the replicated one: ``torch._dynamo.explain``'s graphs
    and graph breaks of one forward of each, the graphs compiled over forwards of ``lengths`` tokens (dynamo's
    ``unique_graphs``, recompiles included), and whether the compiled sharded logits equal the compiled
    replicated ones and the eager replicated ones bit for bit. ``graph_ops=False``: the planner's calls traced
    as Python ([Note: the planner's calls as graph ops] in ``wsharding/core/graph_ops.py``), to show the breaks."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from wsharding.core import graph_ops as ops

    reference, model, ws = sharded_llama(ctx, layers=layers)
    ops.enabled = graph_ops
    out: dict[str, Any] = {"rank": ctx.rank, "layers": layers, "backend": backend, "emulation": ctx.emulation}
    try:
        ids = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(97 * ctx.rank + n))
               for n in lengths]
        compiled = {}
        with torch.no_grad():
            for name, m in (("replicated", reference), ("sharded", model)):
                if explain_only and name == "replicated":
                    continue
                dynamo.reset()
                e = dynamo.explain(m)(input_ids=ids[0], use_cache=False)
                if explain_only:
                    out[name] = {"explain_graphs": e.graph_count, "explain_breaks": e.graph_break_count}
                    return out
                dynamo.reset()
                counters.clear()
                c = torch.compile(m, backend=backend)
                compiled[name] = [c(input_ids=x, use_cache=False).logits for x in ids]
                out[name] = {"explain_graphs": e.graph_count, "explain_breaks": e.graph_break_count,
                             "unique_graphs": counters["stats"]["unique_graphs"],
                             "break_reasons": sorted({k.splitlines()[0] for k in counters["graph_break"]})}
            eager = [reference(input_ids=x, use_cache=False).logits for x in ids]
        out["equal_compiled"] = [bool(torch.equal(a, b)) for a, b in zip(compiled["sharded"], compiled["replicated"],
                                                                          strict=True)]
        out["equal_eager"] = [bool(torch.equal(a, b)) for a, b in zip(compiled["sharded"], eager, strict=True)]
    finally:
        ops.enabled = True
        dynamo.reset()
    return out


def engine_rows(trial: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`run_engine_trial`'s result as table rows (one per variant) in the fields of the package's own
    scheduler's report: KV pool blocks per rank, TTFT / TPOT p50 (ms), output tokens/s per rank, goodput
    (requests/s per rank, when an SLO was given) and whether the tokens equal the other variant's."""
    rows = []
    for variant in ("sharded", "replicated"):
        m = trial[variant]["metrics"]
        rows.append({"engine": "transformers continuous batching", "variant": variant,
                     "kv_blocks_per_rank": trial[variant]["num_blocks"], "page_size": trial[variant]["page_size"],
                     "ttft_p50_ms": m["ttft_ms"]["p50"], "tpot_p50_ms": m["tpot_ms"]["p50"],
                     "output_tok_s_per_rank": m["output_throughput"], "goodput": m.get("goodput"),
                     "preempted": m["preempted"], "tokens_equal": trial["tokens_equal"],
                     "emulated": bool(trial["emulation"])})
    return rows


def engine_compile_counts(ctx: RankContext, counts: Sequence[int] = (3, 1), new_tokens: Sequence[int] = (10, 4),
                          compile_level: int = 1) -> dict[str, Any]:
    """The engine's compiled path (``default_compile_level``) on the sharded model (aligned) and on the
    replicated one: dynamo's graph breaks by reason and ``unique_graphs`` of each run, and whether every token
    is equal. Slow on CPU (inductor builds C++): a measurement, not a test."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    reference, model, ws = sharded_llama(ctx)
    prompts = prompts_for(ctx.rank, counts[ctx.rank], reference.config.vocab_size)
    n = new_tokens[ctx.rank]
    gen, cb = engine_configs(n, compile_level)
    out: dict[str, Any] = {"rank": ctx.rank, "emulation": ctx.emulation, "layers": reference.config.num_hidden_layers}

    def snapshot() -> dict[str, Any]:
        reasons: dict[str, int] = {}
        for k, v in counters["graph_break"].items():
            first = k.splitlines()[0][:120]
            reasons[first] = reasons.get(first, 0) + v
        return {"graph_breaks": sum(counters["graph_break"].values()), "by_reason": reasons,
                "unique_graphs": counters["stats"]["unique_graphs"]}

    dynamo.reset()
    counters.clear()
    outputs, engine = generate(model, ws.comm, prompts, max_new_tokens=n, generation_config=gen, cb_config=cb)
    out["sharded"] = {**snapshot(), "counters": engine.counters.as_dict()}
    dynamo.reset()
    counters.clear()
    expected = replicated_tokens(reference, prompts, n, compile_level)
    out["replicated"] = snapshot()
    out["equal"] = [o.generated_tokens == e for o, e in zip(outputs.values(), expected, strict=True)]
    dynamo.reset()
    return out
