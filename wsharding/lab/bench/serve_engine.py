"""``wsharding bench serve --engine transformers``: the serving benchmark with transformers' continuous
batching as the engine (:mod:`wsharding.lab.tasks.engine_bench` runs it on the ranks).

What is the same as the package's own scheduler (``--engine wsharding``): the workload (each rank's
requests, arrival times, prompt and output lengths from :class:`~wsharding.serve.workload.Workload`,
rescaled to each rate), the budgets (``--budget-gib/--budget-mib``, ``--kv-share``, ``--utilization``),
the SLO, the pairing (both variants on the same arrivals, interleaved per trial, judged over the arrival
window common to the pair: :func:`~wsharding.serve.metrics.pair_metrics`), the warm-up requests left out,
the brackets of sustained rates, and a token check that fails the command.

What differs, said in every output: the engine's KV pool is in its own blocks of ``page_size`` tokens
(:mod:`wsharding.engines.cb_budget`: the budget less the model's resident bytes less a stated reserve
for the engine's tensors); the engine reports no KV blocks in use, no waits for memory and no
recomputed tokens, so those columns (and the regime of a point, which reads them) are absent; its
evictions are counted as preemptions; the token check is the one of [Note: the engine's token check].
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.lab.bench.ranks import auto_comm, run_on_ranks
from wsharding.lab.bench.report import json_path, save_report
from wsharding.lab.bench.serve_report import CPU_NOTE, SLICED_NOTE, rate_label
from wsharding.lab.cliargs import check_output_path
from wsharding.lab.cluster import RankCluster
from wsharding.runtime import gpu_count
from wsharding.serve.metrics import (
    SLO,
    bracket,
    bracket_json,
    bracket_text,
    interval,
    over_trials,
    pair_metrics,
    pair_steady,
)
from wsharding.serve.workload import Workload

ENGINE = "transformers continuous batching"


#: The replicated pool's share of the budget when no budget is given: one where it limits, one where it
#: does not (on CPU ranks the engine's two trash sectors make a 5 % pool of the tiny model empty).
GPU_KV_SHARES = (0.05, 0.5)
CPU_KV_SHARES = (0.3, 0.6)


class EngineMismatch(WshardingError, AssertionError):
    """A request's tokens differ between the replicated and the sharded engine on the same batches
    ([Note: the engine's token check] in :mod:`wsharding.lab.tasks.engine_bench`)."""

#: What the report of the package's own scheduler has that this engine does not give, and why.
MISSING = {
    "waited_for_memory": "the engine's scheduler does not say which requests waited for blocks",
    "recomputed_tokens": "an evicted request is offloaded or reset inside the engine; its recomputed tokens are not "
                         "counted",
    "regime": "read from the replicated run's waits for memory and preemptions: this engine tells its peak blocks "
              "but not its waits, and its peak stays below the pool even while requests wait (its FIFO scheduler "
              "admits no new prompt while less than its safety margin, 15 % by default, of the pool is free)",
    "layer_times": "per-layer gather and compute are traced by the package's planner runs, not inside the engine",
}
#: Options of ``bench serve`` the engine run does not take (refused, not ignored).
NOT_FOR_ENGINE = ("plain", "predict", "from_json", "max_concurrency")


def run_engine_bench(ranks: int, model: str, workload: Workload, *, budgets: list[int] | None = None,
                     kv_shares: list[float] | None = None, utilization: float | None = None,
                     memory_bytes: int | None = None, rates: list[float | None] | None = None, trials: int = 1,
                     max_batch_tokens: int = 64, max_requests: int = 8, page_size: int = 16,
                     reserve_bytes: int | None = None, slo: SLO | None = None, warmup: int | None = None,
                     comm: str = "torch", layers: int | None = None, seed: int = 0, check: bool = True,
                     cluster: RankCluster | None = None) -> dict[str, Any]:
    """Run the engine benchmark on ``ranks`` ranks (or on ``cluster``) and return its report
    (:func:`summarize_engine`). Budgets as :func:`~wsharding.lab.bench.serve.run_serve_bench` takes
    them; none given: :data:`GPU_KV_SHARES` (:data:`CPU_KV_SHARES` on CPU ranks)."""
    from wsharding.lab.tasks.engine_bench import engine_bench_rank

    specs: list[dict[str, Any]] = [{"bytes": int(b)} for b in budgets or []]
    specs += [{"kv_share": float(s)} for s in kv_shares or []]
    if utilization is not None:
        specs.append({"utilization": utilization, "memory_bytes": memory_bytes})
    specs = specs or [{"kv_share": s} for s in (GPU_KV_SHARES if gpu_count() else CPU_KV_SHARES)]
    if rates is None:
        rates = [None if math.isinf(workload.rate) else workload.rate]
    kwargs = dict(workload=workload.as_dict(), budgets=specs, rates=rates, trials=trials,
                  max_batch_tokens=max_batch_tokens, max_requests=max_requests, page_size=page_size,
                  reserve_bytes=reserve_bytes, comm=comm, layers=layers, seed=seed, check=check)
    results = run_on_ranks("run_engine_bench", ranks, cluster, engine_bench_rank, model, **kwargs)
    return summarize_engine(results, slo, warmup)


def _point(results: list[dict[str, Any]], b: int, ri: int, warmup: int, slo: SLO | None) -> dict[str, Any]:
    """Both variants at one (budget, rate), judged as a pair per trial, then over trials."""
    r0 = results[0]
    trials: dict[str, list[dict[str, Any]]] = {"replicated": [], "sharded": []}
    counts: dict[str, dict[str, list[float]]] = {v: {"preemptions": [], "idle_steps": [], "steps": []}
                                                  for v in trials}
    realised, first = [], {v: [] for v in trials}
    for t in range(r0["trials"]):
        key = f"{b}/{ri}/{t}"
        pair = pair_metrics({v: [rec for r in results for rec in r["runs"][v][key]["records"]] for v in trials},
                            len(results), warmup, slo)
        realised += [r["runs"]["replicated"][key]["realised_rate"] for r in results]
        for v in trials:
            trials[v].append(pair[v])
            for k in counts[v]:
                counts[v][k].append(sum(r["runs"][v][key][k] for r in results))
            first[v].append(r0["runs"][v][key]["first"])
    point: dict[str, Any] = {"rate": r0["rates"][ri], "realised_rate": interval(realised)}
    for v in trials:
        # the most blocks any rank's pool held (each rank has its own pool of the same size), per trial
        peaks = [[r["runs"][v][f"{b}/{ri}/{t}"].get("kv_peak_blocks") for r in results] for t in range(r0["trials"])]
        by_trial = None if any(None in p for p in peaks) else [max(p) for p in peaks]
        peak = None if by_trial is None else {"max": max(by_trial), "by_trial": by_trial}
        point[v] = {**over_trials(trials[v]), **{k: interval(xs) for k, xs in counts[v].items()},
                    "kv_peak_blocks": peak, "counts_by_trial": counts[v], "first_in_trials": first[v],
                    "trials": trials[v]}
    return point


def summarize_engine(results: list[dict[str, Any]], slo: SLO | None = None, warmup: int | None = None) -> dict[str, Any]:
    """The report from every rank's :func:`~wsharding.lab.tasks.engine_bench.engine_bench_rank` result:
    per budget each variant's pool (blocks, tokens, bytes, share of the budget -- every rank's the same,
    or refused), per rate both variants' serving metrics, the brackets and goodput ratios; the token
    check; what is absent and why (:data:`MISSING`)."""
    r0 = results[0]
    requests = r0["workload"]["requests"]
    warmup = requests // 10 if warmup is None else warmup
    if warmup >= requests:
        raise InvalidArgument(f"warm-up: {warmup} requests per rank leaves none of {requests} to measure")
    for r in results[1:]:
        if r["pools"] != r0["pools"]:
            raise InvalidArgument(f"rank {r['rank']} sized other pools than rank 0 ({r['pools']} vs {r0['pools']})")
    variants = ["replicated", "sharded"]
    target = 1.0 if slo is None else slo.attainment
    rows = []
    for b, budget in enumerate(r0["budgets"]):
        row: dict[str, Any] = {"budget_bytes": budget, "budget_spec": r0["budget_specs"][b], "points": []}
        for v in variants:
            blocks = r0["pools"][v][b]
            row[v] = {"pool_blocks": blocks, "pool_tokens": blocks * r0["page_size"],
                      "pool_bytes": blocks * r0["block_bytes"], "kv_share": blocks * r0["block_bytes"] / budget}
        for ri in range(len(r0["rates"])):
            row["points"].append(_point(results, b, ri, warmup, slo))
        steady = [pair_steady(p["rate"], {v: p[v]["drain_share"]["mean"] for v in variants},
                              {v: p[v]["attainment"]["mean"] if "attainment" in p[v] else None for v in variants},
                              target) for p in row["points"]]
        row["answer"] = {"steady": steady, "brackets": None, "goodput_ratio": None}
        if slo is not None:
            xs = [math.inf if p["rate"] is None else p["rate"] for p in row["points"]]
            row["answer"]["brackets"] = {
                v: bracket_json(bracket(xs, [p[v]["attainment"]["mean"] for p in row["points"]], target, steady))
                for v in variants}
            row["answer"]["goodput_ratio"] = [
                p["sharded"]["goodput"]["mean"] / p["replicated"]["goodput"]["mean"]
                if p["replicated"]["goodput"]["mean"] else None for p in row["points"]]
        rows.append(row)
    differ = [{"rank": r["rank"], "budget_bytes": r0["budgets"][int(k.split("/")[0])],
               "rate": r0["rates"][int(k.split("/")[1])], "requests": ids}
              for r in results for k, ids in r["differ"].items() if ids]
    own = sum(len(ids) for r in results for ids in r["own_differ"].values())
    notes = [r0["emulation"]] if r0.get("emulation") else []
    notes += [CPU_NOTE] if r0["device"] == "cpu" else [SLICED_NOTE] if r0["ranks_per_device"] > 1 else []
    keep = ("device", "world_size", "ranks_per_device", "communicator", "model", "layers", "dtype", "rates", "trials",
            "budgets", "page_size", "block_bytes", "max_batch_tokens", "max_requests", "max_context", "sizing",
            "workload_text", "checked")
    try:
        import transformers

        version = transformers.__version__
    except ImportError:  # the ranks imported it; this process may run elsewhere
        version = None
    # not "serve": a saved engine report is not one --from-json can read (its fields differ), and says so
    return {"bench": "serve-engine", "engine": ENGINE, "transformers": version, "date": time.strftime("%Y-%m-%d"),
            **{k: r0[k] for k in keep}, "workload": {k: v for k, v in r0["workload"].items() if k != "lengths"},
            "slo": None if slo is None else slo.as_dict(), "slo_text": None if slo is None else slo.describe(),
            "warmup_requests": warmup, "variants": variants, "notes": notes, "rows_by_budget": rows,
            "missing": MISSING, "differ": differ, "equal": not differ and bool(r0["checked"]),
            "own_schedule_differ": {"requests": own, "of": sum(len(r["own_differ"]) for r in results) * requests},
            "agreement": [{"rank": r["rank"], "rounds": sum(run["rounds"] for run in r["runs"]["sharded"].values()),
                           "agree_s": sum(run["agree_s"] for run in r["runs"]["sharded"].values())} for r in results]}


def _iv(x: dict[str, Any] | None, fmt: str = ",.1f") -> str:
    if not x or x["mean"] is None:
        return "-"
    return f"{x['mean']:{fmt}}" + ("" if x["half"] is None else f"±{x['half']:{fmt}}")


def _lat(x: dict[str, Any], key: str, stat: str) -> str:
    """A latency statistic's mean over trials, ms."""
    m = x[key][stat]["mean"]
    return "-" if m is None else f"{m:,.1f}"


def _peak(peak: dict[str, Any] | None, pool: int) -> str:
    """``max/pool`` blocks (the largest peak over trials), ``-`` where the engine gave no count."""
    return "-" if peak is None else f"{peak['max']:,}/{pool:,}"


def _mib(b: float) -> str:
    return f"{b / 2**30:,.2f} GiB" if b >= 2**30 else f"{b / 2**20:,.2f} MiB"


def format_engine_table(report: dict[str, Any]) -> str:
    """The report as text: the set-up and its notes, per budget both pools, per rate both variants'
    latencies, goodput and counts, the answer, the token check, what the engine does not report."""
    s = report["sizing"]
    lines = [f"wsharding bench serve --engine transformers -- {ENGINE} (transformers {report['transformers']}), "
             f"{report['world_size']} ranks" + (f" ({report['ranks_per_device']} per GPU, time-sliced)"
                                                if report["ranks_per_device"] > 1 and report["device"] != "cpu" else "")
             + f", {report['model']} Llama ({report['layers']} layers, {report['dtype']}), random weights, "
             f"gathers by {report['communicator']}"]
    lines += [f"  NOTE: {n}" for n in report["notes"]]
    lines.append(f"  workload: {report['workload_text']}; {report['trials']} trial(s) per point, the first "
                 f"{report['warmup_requests']} requests per rank left out (warm-up)")
    lines.append("  judged as a pair: both variants serve the same arrivals, interleaved per trial, the first "
                 "alternating; goodput over the arrival window common to both; replicated engines run free, sharded "
                 "engines aligned (one agreement per round; dummy steps counted)")
    lines.append(f"  engine: at most {report['max_batch_tokens']} tokens and {report['max_requests']} requests per "
                 f"batch; KV in blocks of {report['page_size']} tokens, {report['block_bytes']:,} B each")
    lines.append("  resident: " + ", ".join(f"{v} {_mib(s[v]['resident_bytes'])}" for v in report["variants"])
                 + f"; reserve for the engine's tensors {_mib(s['replicated']['reserve_bytes'])}")
    lines.append(f"  SLO: {report['slo_text'] or 'none given (no goodput)'}")
    head = (f"    {'':<12}{'req/s':>12}{'out tok/s':>14}{'TTFT mean/p99':>17}{'TPOT mean/p99':>16}"
            f"{'goodput':>13}{'met':>6}{'preempt':>9}{'KV peak/pool':>14}{'idle steps':>12}{'drain':>7}")
    for row in report["rows_by_budget"]:
        lines.append(f"  budget {_mib(row['budget_bytes'])} per rank: KV pool " + ", ".join(
            f"{v} {row[v]['pool_blocks']:,} blocks = {row[v]['pool_tokens']:,} tokens ({row[v]['kv_share']:.1%} of "
            "the budget)" for v in report["variants"]))
        for p, ok in zip(row["points"], row["answer"]["steady"], strict=True):
            real = p["realised_rate"]["mean"]
            lines.append(f"   rate {rate_label(p['rate'])} per rank" + ("" if real is None else f" (realised "
                         f"{real:.3f}/s)") + ("" if ok else "; NOT A STEADY STATE (more --requests)"))
            lines.append(head)
            for v in report["variants"]:
                x = p[v]
                met = f"{x['attainment']['mean']:.0%}" if "attainment" in x else "-"
                lines.append(f"    {v:<12}{_iv(x['request_throughput'], '.2f'):>12}{_iv(x['output_throughput']):>14}"
                             f"{_lat(x, 'ttft_ms', 'mean') + '/' + _lat(x, 'ttft_ms', 'p99'):>17}"
                             f"{_lat(x, 'tpot_ms', 'mean') + '/' + _lat(x, 'tpot_ms', 'p99'):>16}"
                             f"{_iv(x.get('goodput'), '.2f'):>13}"
                             f"{met:>6}"
                             f"{_iv(x['preemptions'], '.0f'):>9}"
                             f"{_peak(x.get('kv_peak_blocks'), row[v]['pool_blocks']):>14}"
                             f"{_iv(x['idle_steps'], ',.0f'):>12}"
                             f"{x['drain_share']['mean']:>7.0%}")
        a = row["answer"]
        if a["brackets"] is not None:
            ratios = ", ".join(f"{rate_label(p['rate'])} " + ("-" if g is None else f"{g:.2f}x")
                               for p, g in zip(row["points"], a["goodput_ratio"], strict=True))
            lines.append("   ANSWER: per rank, " + "; ".join(f"{v} {bracket_text(a['brackets'][v])}"
                                                             for v in report["variants"])
                         + f"; goodput sharded/replicated {ratios}")
    own = report["own_schedule_differ"]
    if report["equal"]:
        lines.append("  tokens: both engines served every request of the first trial again, all queued before the "
                     "engine started (the same batches): every token equal on every rank"
                     + (f"; in the timed runs {own['requests']} of {own['of']} requests parted (other batches: "
                        "other last bits)" if own["requests"] else "; the timed runs' tokens were equal too"))
    elif not report["checked"]:
        lines.append("  tokens: NOT CHECKED (--no-check)")
    else:
        lines.append("  TOKENS DIFFER in the check: " + "; ".join(
            f"rank {d['rank']} requests {d['requests']} at budget {_mib(d['budget_bytes'])}, rate "
            f"{rate_label(d['rate'])}" for d in report["differ"]))
    lines.append("  not reported by this engine: " + "; ".join(f"{k} ({why})" for k, why in report["missing"].items()))
    return "\n".join(lines)


class NoEngineFigure(WshardingError, ImportError):
    """No figure for an engine run; an ImportError so that :func:`save_report` says so and saves the JSON."""


def _no_figure(report: dict[str, Any]) -> Any:
    """The goodput figure draws the package scheduler's report (its regimes, KV blocks): none for this one."""
    raise NoEngineFigure("an engine run is saved as JSON only (the serve figures read fields this engine does not give)")


def main(args: argparse.Namespace) -> int:
    """``bench serve --engine transformers``: the options of ``bench serve``, the engine's defaults."""
    given = [f"--{k.replace('_', '-')}" for k in NOT_FOR_ENGINE if getattr(args, k, None)]
    if args.dataset != "random":
        given.append(f"--dataset {args.dataset}")
    if given:
        raise InvalidArgument(f"--engine transformers does not take {', '.join(given)} (the package's own scheduler "
                              "does: --engine wsharding)")
    check_output_path(str(json_path(args.json)) if args.json else "", "--json")  # before the ranks serve for minutes
    gpus = gpu_count()
    rates = args.rate or ([2.0, 4.0, 8.0] if gpus else [8.0, 32.0])
    wl = Workload(requests=args.requests or (60 if gpus else 12), prompt=args.prompt or ((64, 512) if gpus else (8, 24)),
                  output=args.output or ((128, 512) if gpus else (4, 16)), rate=rates[0], seed=args.seed,
                  burstiness=args.burstiness)
    budgets = [int(b * 2**30) for b in args.budget_gib or []] + [int(b * 2**20) for b in args.budget_mib or []]
    slo = args.slo or (SLO(ttft_ms=2000, tpot_ms=200) if gpus else SLO(ttft_ms=1000, tpot_ms=100))
    model = args.hf_model or ("llama-1b" if gpus else "tiny")
    report = run_engine_bench(
        args.ranks or 2, model, wl, budgets=budgets or None, kv_shares=args.kv_share, utilization=args.utilization,
        memory_bytes=None if args.memory_gib is None else int(args.memory_gib * 2**30),
        rates=[None if math.isinf(r) else r for r in rates], trials=args.trials,
        max_batch_tokens=args.token_budget or (256 if gpus else 32), max_requests=args.max_seqs or (64 if gpus else 8),
        reserve_bytes=None if args.reserve_mib is None else int(args.reserve_mib * 2**20), slo=slo,
        warmup=args.warmup, comm=auto_comm(args.comm), layers=args.layers, seed=args.seed, check=not args.no_check)
    print(format_engine_table(report))
    if args.json:
        save_report(report, args.json, _no_figure)
    if report["differ"]:
        raise EngineMismatch("the sharded engine generated other tokens than the replicated one on the same batches: "
                            + "; ".join(f"rank {d['rank']} requests {d['requests']}" for d in report["differ"]))
    return 0
