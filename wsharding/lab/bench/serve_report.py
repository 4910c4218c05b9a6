"""The report of ``wsharding bench serve`` from every rank's result, and its text.

The variants are judged as a **pair** at every point (:mod:`wsharding.serve.metrics`): the same
arrivals, goodput over one window common to both, a point that proves a rate only where the arrivals
covered most of the time measured for every variant that met the SLO. The headline (:func:`answer`)
is, per budget, each variant's highest sustained rate **bracketed** by the first rate it failed, the
goodput ratio at every rate and each point's regime (pool-limited where the replicated pool ran out,
else compute-limited); :func:`crossover` sets the ratio of sustained rates against the pool ratio,
beside what the cost model makes of the two (pool ratio / step-time ratio, the step times measured in
the same run). Beside it: per sharded layer, gather against compute at the shapes the run used, with
the cost model's prediction for the same layer on the GPUs of its datasheet; and how the steps ran --
per budget and variant, the steps replayed from CUDA graphs and run eagerly, the shapes captured and
the capture's seconds (:func:`graph_counts`), or, in one line, why both variants ran every step eagerly.

:func:`read_serve_report` reads a saved report back after checking it against the report's schema
(:func:`~wsharding.lab.bench.serve_schema.check_report`): every figure it reads is there, of its type and in its range, before any is
read; the answers are computed again from the points, never read from the file.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.costmodel.devices import get_device
from wsharding.costmodel.plan import breakeven, gather_seconds
from wsharding.lab.bench.serve_schema import SCHEMA, check_report, parse_report
from wsharding.serve import BLOCK_TOKENS, pool_blocks
from wsharding.serve.metrics import (
    SLO,
    bracket,
    bracket_json,
    bracket_text,
    interval,
    over_trials,
    pair_metrics,
    pair_steady,
    regime,
    request_metrics,
)

#: The datasheet the per-layer prediction uses (a deployment's GPUs, not the machine that ran).
PREDICT_ON = "h200"
#: The deployment this benchmark scales down: Kimi K3 in FP8 on 8 B200s (notebook 07, section 1).
DESIGN_PRESET, DESIGN_RANKS, DESIGN_DEVICE = "kimi-k3-b200-fp8", 8, "b200"

#: Said in every output of a run on CPU ranks.
CPU_NOTE = ("CPU ranks: the budgets are emulated (a number per rank, not the machine's memory), times are CPU times "
            "on shared cores; token counts, blocks and scheduler decisions are exact")
#: Said in every output of a run of several ranks on one GPU.
SLICED_NOTE = ("time-sliced: the ranks share one GPU, so a gather is a copy inside it, not over a link, and the "
               "ranks' steps take turns")


def rate_label(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:g}/s"


#: The counts each run keeps, summed over ranks (or their most, ``peak``), then spread over trials.
COUNTS = {"preemptions": sum, "recomputed_tokens": sum, "waited_for_memory": sum, "idle_steps": sum,
          "peak_blocks": max, "peak_in_flight": max}


def _points(results: list[dict[str, Any]], variants: list[str], b: int, ri: int, warmup: int,
            slo: SLO | None) -> dict[str, Any]:
    """Every variant at one (budget, rate), judged as a pair per trial (:func:`~wsharding.serve.metrics.pair_metrics`):
    each trial's metrics, then their intervals over trials, the counts per trial and their spread."""
    r0 = results[0]
    trials: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    counts: dict[str, dict[str, list[float]]] = {v: {k: [] for k in COUNTS} for v in variants}
    extra: dict[str, dict[str, Any]] = {v: {"max_concurrency": 0, "steps": 0, "tokens_per_step": [],
                                            "mean_concurrency": [], "kv_blocks": [], "first": []} for v in variants}
    by_bucket: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    realised = []
    for t in range(r0["trials"]):
        key = f"{b}/{ri}/{t}"
        pair = pair_metrics({v: [rec for r in results for rec in r["runs"][v][key]["records"]] for v in variants},
                            len(results), warmup, slo)
        realised += [r["runs"]["replicated"][key]["realised_rate"] for r in results]
        for v in variants:
            trials[v].append(pair[v])
            runs = [r["runs"][v][key] for r in results]
            for k, how in COUNTS.items():
                counts[v][k].append(how(run[k] for run in runs))
            e = extra[v]
            e["max_concurrency"] = max(e["max_concurrency"], *(run["max_concurrency"] for run in runs))
            e["steps"] = max(e["steps"], *(run["steps"] for run in runs))
            e["tokens_per_step"] += [run["tokens_per_step"] for run in runs]
            e["mean_concurrency"] += [run["mean_concurrency"] for run in runs]
            e["first"].append(runs[0]["first"])
            e["kv_blocks"] += [{"trial": t, "rank": r["rank"], **r["runs"][v][key]["kv_blocks"]} for r in results]
            for run in runs:
                for k, c in run["steps_by_bucket"].items():
                    acc = by_bucket[v].setdefault(k, [0, 0.0, 0])
                    acc[0] += c["steps"]
                    acc[1] += c["seconds"]
                    acc[2] += c["working"]
    point: dict[str, Any] = {"realised_rate": interval(realised)}
    for v in variants:
        out = over_trials(trials[v])
        e = extra[v]
        out.update({k: interval(xs) for k, xs in counts[v].items()})
        out.update(max_concurrency=e["max_concurrency"], steps=e["steps"],
                   tokens_per_step=statistics.fmean(e["tokens_per_step"]),
                   mean_concurrency=statistics.fmean(e["mean_concurrency"]), first_in_trials=e["first"],
                   step_ms_by_bucket={k: {"steps": a[0], "working": a[2], "mean_ms": 1e3 * a[1] / a[0]}
                                      for k, a in sorted(by_bucket[v].items(), key=lambda x: int(x[0]))},
                   kv_blocks=e["kv_blocks"], counts_by_trial=counts[v], trials=trials[v])
        point[v] = out
    return point


def _mean(point: dict[str, Any], key: str) -> float | None:
    return point[key]["mean"] if key in point else None


def point_steady(point: dict[str, Any], variants: list[str], slo: SLO | None) -> bool:
    """Whether a point of a report proves rates, for the pair (:func:`~wsharding.serve.metrics.pair_steady`)."""
    target = 1.0 if slo is None else slo.attainment
    return pair_steady(point["rate"], {v: point[v]["drain_share"]["mean"] for v in variants},
                       {v: _mean(point[v], "attainment") for v in variants}, target)


def point_regime(point: dict[str, Any]) -> str:
    """A point's regime, from the replicated runs there (:func:`~wsharding.serve.metrics.regime`)."""
    rep = point["replicated"]
    return regime(rep["preemptions"]["mean"] or 0, rep["waited_for_memory"]["mean"] or 0)


def answer(row: dict[str, Any], rates: list[float | None], variants: list[str], slo: SLO | None) -> dict[str, Any]:
    """Per variant its :func:`~wsharding.serve.metrics.bracket` over the points that prove rates (all
    at once counts as infinite), the goodput ratio of each sharded variant at each rate (over the
    window common to the pair), and each point's steadiness and regime."""
    steady = [point_steady(p, variants, slo) for p in row["points"]]
    regimes = [point_regime(p) for p in row["points"]]
    if slo is None:
        return {"brackets": None, "goodput_ratio": None, "steady": steady, "regime": regimes}
    xs = [math.inf if r is None else r for r in rates]
    brackets = {}
    for v in variants:
        brackets[v] = bracket_json(bracket(xs, [_mean(p[v], "attainment") for p in row["points"]], slo.attainment,
                                           steady))
    ratio = {}
    for v in variants[1:]:
        ratio[v] = []
        for p in row["points"]:
            rep, got = _mean(p["replicated"], "goodput"), _mean(p[v], "goodput")
            ratio[v].append(got / rep if rep else None)
    return {"brackets": brackets, "goodput_ratio": ratio, "steady": steady, "regime": regimes}


def answer_text(row: dict[str, Any], variants: list[str]) -> str:
    """The answer as one sentence: per variant its bracket, then the goodput ratio and the regime at
    each rate (the ANSWER line of :func:`format_table`, and what notebook 07 prints)."""
    a = row["answer"]
    if a["brackets"] is None:
        return "no SLO given: no rate is judged"
    best = "; ".join(f"{v} {bracket_text(a['brackets'][v])}" for v in variants)
    ratios = "; ".join(
        f"goodput {v}/replicated " + ", ".join(
            f"{rate_label(p['rate'])} {_v(g, '.2f')}x ({reg}{'' if ok else ', not a steady state'})"
            for p, g, reg, ok in zip(row["points"], a["goodput_ratio"][v], a["regime"], a["steady"], strict=True))
        for v in variants[1:])
    return f"per rank, {best}; {ratios}"


def step_time_ratio(row: dict[str, Any], variant: str) -> float | None:
    """The sharded variant's step time over the replicated one's, measured in this run at this budget:
    per token bucket the mean step time of each, weighted by the replicated variant's working steps in
    that bucket (the mix of steps a replicated server ran), over the buckets both ran."""
    num = den = 0.0
    for p in row["points"]:
        rep, got = p["replicated"]["step_ms_by_bucket"], p[variant]["step_ms_by_bucket"]
        for k, c in rep.items():
            if k in got and c["working"]:
                num += c["working"] * got[k]["mean_ms"]
                den += c["working"] * c["mean_ms"]
    return num / den if den > 0 else None


def crossover(rows: list[dict[str, Any]], variants: list[str]) -> list[dict[str, Any]]:
    """Per budget and sharded variant: the pool ratio (sharded pool tokens / replicated), the measured
    step-time ratio, the cost model's line (pool ratio / step-time ratio where the replicated pool is
    the limit; 1 / step-time ratio where compute is), and the measured ratio of sustained rates with
    what kind of number it is: ``exact`` (both bracketed), ``lower`` (the sharded one passed every
    rate), ``upper`` (the replicated one did), None when it cannot be told."""
    out = []
    for b, row in enumerate(rows):
        br = row["answer"]["brackets"]
        # the regime where the replicated variant's answer is decided: its first failing rate, else its last
        rep = br["replicated"] if br else None
        at = len(row["points"]) - 1
        if rep and rep["fails_at"] is not None:
            at = next(i for i, p in enumerate(row["points"]) if p["rate"] == rep["fails_at"])
        reg = row["answer"]["regime"][at]
        for v in variants[1:]:
            pool = row[v]["pool_tokens"] / row["replicated"]["pool_tokens"]
            step = step_time_ratio(row, v)
            item = {"budget": b, "variant": v, "kv_share": row["replicated"]["kv_share"], "pool_ratio": pool,
                    "step_time_ratio": step, "regime": reg,
                    "predicted_pool_limited": None if not step else pool / step,
                    "predicted_compute_limited": None if not step else 1 / step,
                    "ratio": None, "bound": None}
            item["predicted"] = item["predicted_pool_limited" if reg == "pool-limited" else "predicted_compute_limited"]
            if br:
                item["ratio"], item["bound"] = _rate_ratio(br[v], br["replicated"])
            out.append(item)
    return out


def _rate_ratio(s: dict[str, Any], r: dict[str, Any]) -> tuple[float | None, str | None]:
    """The ratio of two brackets' sustained rates (sharded ``s`` over replicated ``r``) and what kind of
    number it is: ``exact`` (both bracketed: each a rate of the grid passed, the next failed),
    ``lower`` / ``upper`` where one side is open -- a variant that passed every rate, or one below the
    lowest (then the lowest rate stands for it: the ratio is beyond it) -- None when both are open the
    same way (the sweep reached neither limit, or both failed its lowest rate)."""
    def side(b: dict[str, Any]) -> tuple[float | None, str]:
        if b["kind"] == "bracketed":
            return b["sustained"], "exact"
        if b["kind"] == "at least" and b["sustained"] is not None:
            return b["sustained"], "up"  # the true rate is higher
        if b["kind"] == "below the lowest" and b["fails_at"] is not None:
            return b["fails_at"], "down"  # the true rate is lower
        return None, "none"

    (a, ka), (b, kb) = side(s), side(r)
    if a is None or b is None or (ka == kb and ka != "exact"):
        return None, None
    if ka == "exact" and kb == "exact":
        return a / b, "exact"
    lower = ka == "up" or kb == "down"
    upper = ka == "down" or kb == "up"
    if lower and upper:
        return None, None
    return a / b, "lower" if lower else "upper"


def crossover_text(items: list[dict[str, Any]]) -> list[str]:
    lines = []
    for c in items:
        measured = "not told (neither variant's rate is bracketed by the sweep)" if c["ratio"] is None else (
            {"exact": "", "lower": "at least ", "upper": "at most "}[c["bound"]] + f"{c['ratio']:.2f}x")
        pred = "-" if c["predicted"] is None else f"{c['predicted']:.2f}x"
        step = "-" if c["step_time_ratio"] is None else f"{c['step_time_ratio']:.2f}"
        lines.append(f"    replicated KV share {c['kv_share']:.1%}: pool ratio {c['pool_ratio']:.2f}, step-time ratio "
                     f"{step}, {c['regime']}: sustained rate {c['variant']}/replicated {measured}; cost model {pred}")
    return lines


def predicted_layers(measured: list[dict[str, Any]], ranks: int, itemsize: int) -> list[dict[str, Any]]:
    """Per probed layer and shape, the cost model's gather and compute on :data:`PREDICT_ON`'s datasheet
    (its NVLink, its dense peak) beside what was measured, and the tokens per step where the gather hides."""
    dev = get_device(PREDICT_ON)
    peak = dev.peak_flops[{1: "fp8", 2: "bf16", 4: "tf32"}[itemsize]]
    out = []
    for m in measured:
        gather = gather_seconds(m["layout_bytes"], ranks, dev.link_bandwidth)
        per_token = 2 * (m["payload_bytes"] // itemsize) / peak
        out.append({**m, "predicted_gather_us": 1e6 * gather, "predicted_compute_us": 1e6 * per_token * m["tokens"],
                    "predicted_hide_tokens": breakeven(gather, per_token)})
    return out


def summarize(results: list[dict[str, Any]], slo: SLO | None = None, warmup: int | None = None) -> dict[str, Any]:
    """The benchmark's report from every rank's :func:`~wsharding.lab.tasks.serve.serve_rank` result.
    ``warmup``: requests per rank left out of the metrics (default a tenth of them)."""
    r0 = results[0]
    sizing, per_token = r0["sizing"], r0["kv_bytes_per_token"]
    variants = list(r0["runs"])  # replicated first, then the sharded ones
    requests = r0["workload"]["requests"]
    warmup = requests // 10 if warmup is None else warmup
    if warmup >= requests:
        raise InvalidArgument(f"warm-up: {warmup} requests per rank leaves none of {requests} to measure")
    rows = []
    for b, budget in enumerate(r0["budgets"]):
        row: dict[str, Any] = {"budget_bytes": budget, "budget_spec": r0["budget_specs"][b], "points": []}
        for ri, rate in enumerate(r0["rates"]):
            row["points"].append({"rate": rate, **_points(results, variants, b, ri, warmup, slo)})
        first = f"{b}/0/0"
        for v in variants:
            run = r0["runs"][v][first]
            row[v] = {"pool_tokens": min(r["runs"][v][first]["pool_tokens"] for r in results),
                      "pool_blocks": run["pool_blocks"], "pool_bytes": run["pool_bytes"],
                      "kv_share": run["pool_bytes"] / budget,
                      "max_concurrency": max(p[v]["max_concurrency"] for p in row["points"]),
                      "preemptions": sum(sum(p[v]["counts_by_trial"]["preemptions"]) for p in row["points"])}
            if "graphs" in r0:
                row[v]["graphs"] = graph_counts(results, v, b)
        row["predicted"] = {"replicated": {"pool_tokens": row["replicated"]["pool_tokens"]}}
        for v in variants[1:]:
            resident = sizing["replicated"]["resident_bytes"] - sizing[v]["net_saving_bytes_predicted"]
            try:
                tokens = pool_blocks(budget, resident, sizing[v]["reserve_bytes"], per_token) * BLOCK_TOKENS
            except WshardingError:
                tokens = 0
            row["predicted"][v] = {"pool_tokens": tokens}
        row["answer"] = answer(row, r0["rates"], variants, slo)
        rows.append(row)
    differ = [{"rank": r["rank"], "budget_bytes": r0["budgets"][int(k.split("/")[0])],
               "rate": r0["rates"][int(k.split("/")[1])], "requests": ids}
              for r in results for k, ids in r["differ"].items() if ids]
    own = sum(len(ids) for r in results for ids in r["own_differ"].values())
    compared = sum(len(r["own_differ"]) for r in results) * requests
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}.get(r0.get("dtype", "bfloat16"), 2)
    keep = ("mode", "emulation", "device", "device_memory_bytes", "communicator", "world_size", "ranks_per_device",
            "preset", "layers", "dtype", "workload_text", "kv_bytes_per_token", "token_budget", "max_seqs",
            "max_concurrency", "max_context", "rates", "trials", "budgets", "checked")
    workload = {k: v for k, v in r0["workload"].items() if k != "lengths"}  # a trace's pairs would swamp the JSON
    return {"bench": "serve", "schema": SCHEMA, "date": time.strftime("%Y-%m-%d"), **{k: r0.get(k) for k in keep},
            "workload": workload, "slo": None if slo is None else slo.as_dict(),
            "slo_text": None if slo is None else slo.describe(), "warmup_requests": warmup, "variants": variants,
            "sizing": sizing, "graphs": {k: r0["graphs"][k] for k in ("mode", "eager_reason")} if "graphs" in r0 else None,
            "rows_by_budget": rows, "crossover": crossover(rows, variants), "notes": notes(r0),
            "layer_times": predicted_layers(r0["layer_times"], r0["world_size"], itemsize) if r0["layer_times"] else [],
            "layer_times_by_rank": [r["layer_times"] for r in results],
            "requests": request_records(results, variants, slo, warmup),
            "differ": differ, "equal": not differ and bool(r0["checked"]),
            "own_schedule_differ": {"requests": own, "of": compared}}


def graph_counts(results: list[dict[str, Any]], variant: str, b: int) -> dict[str, Any]:
    """One variant's CUDA graphs at budget ``b``, over every rank and measured run there: steps replayed
    and run eagerly (summed), the shapes captured on its pool (the same on every rank) and the seconds
    the captures took (the slowest rank's)."""
    runs = [run for r in results for key, run in r["runs"][variant].items() if key.startswith(f"{b}/")]
    info = [r["graphs"]["by_budget"][b][variant] for r in results]
    return {"graphed_steps": sum(run["graphed_steps"] for run in runs),
            "eager_steps": sum(run["eager_steps"] for run in runs),
            "shapes": max(i["shapes"] for i in info), "capture_s": max(i["capture_s"] for i in info),
            "pools": max(i["pools"] for i in info),
            "replay_graphed_steps": sum(i["replay_graphed_steps"] for i in info),
            "replay_eager_steps": sum(i["replay_eager_steps"] for i in info)}


def graphs_lines(report: dict[str, Any], row: dict[str, Any]) -> list[str]:
    """A budget's CUDA graphs per variant, one line; none where every step ran eagerly (the report's
    one line says why) or the report predates graphs."""
    g = report.get("graphs")
    if not g or g["eager_reason"] is not None:
        return []
    return ["   CUDA graphs: " + "; ".join(
        f"{v} {row[v]['graphs']['graphed_steps']:,} steps replayed, {row[v]['graphs']['eager_steps']:,} eager, "
        f"{row[v]['graphs']['shapes']} shapes captured in {row[v]['graphs']['capture_s']:.2f} s"
        for v in report["variants"] if "graphs" in row[v])]


def graphs_line(report: dict[str, Any]) -> list[str]:
    """How the steps ran, one line: decode steps from CUDA graphs, or every step eagerly and why."""
    g = report.get("graphs")
    if not g:
        return []
    if g["eager_reason"] is not None:
        return [f"  CUDA graphs: none (--graphs {g['mode']}): {g['eager_reason']}"]
    return [f"  CUDA graphs (--graphs {g['mode']}): both variants replay the decode-only steps of the shapes a warm-up "
            "trial met on any rank (captured on each variant's pool, one per budget, reused and reset per trial); "
            "other steps run eagerly"]


def request_records(results: list[dict[str, Any]], variants: list[str], slo: SLO | None,
                    warmup: int) -> list[dict[str, Any]]:
    """Every request of every run, one flat record each: where it ran, its times and lengths, its
    latencies and every inter-token latency (ms, to the microsecond), whether it was measured and
    met the SLOs."""
    out = []
    for r in results:
        for v in variants:
            for key, run in r["runs"][v].items():
                b, ri, t = (int(x) for x in key.split("/"))
                for rec in run["records"]:
                    m = request_metrics(rec)
                    out.append({"variant": v, "budget": b, "rate": r["rates"][ri], "trial": t, "rank": rec["rank"],
                                "rid": rec["rid"], "arrival_s": rec["arrival_s"], "sent_s": rec["sent_s"],
                                "first_token_s": rec["token_s"][0], "last_token_s": rec["token_s"][-1],
                                "prompt_tokens": rec["prompt_tokens"], "output_tokens": rec["output_tokens"],
                                "preempted": rec["preempted"], "ttft_ms": m["ttft_ms"], "tpot_ms": m["tpot_ms"],
                                "e2e_ms": m["e2e_ms"], "itl_ms_max": max(m["itl_ms"], default=None),
                                "itl_ms": [round(x, 3) for x in m["itl_ms"]],
                                "measured": rec["rid"] >= warmup, "met_slo": None if slo is None else slo.met(m)})
    return out


def _mib(b: float) -> str:
    if b >= 10 * 2**30:
        return f"{b / 2**30:,.1f} GiB"
    return f"{b / 2**20:,.2f} MiB" if b < 100 * 2**20 else f"{b / 2**20:,.1f} MiB"


def _iv(x: dict[str, Any] | None, fmt: str = ",.1f") -> str:
    """``mean ±half`` of an interval."""
    if not x or x["mean"] is None:
        return "-"
    return f"{x['mean']:{fmt}}" + ("" if x["half"] is None else f"±{x['half']:{fmt}}")


def _v(x: float | None, fmt: str = ",.1f") -> str:
    return "-" if x is None else f"{x:{fmt}}"


def notes(report: dict[str, Any]) -> list[str]:
    """What every output of a report (or a rank's result) must say about its times."""
    out = []
    if report.get("emulation"):
        out.append(report["emulation"])
    if report["device"] == "cpu":
        out.append(CPU_NOTE)
    elif report["ranks_per_device"] > 1:
        out.append(SLICED_NOTE)
    return out


def format_table(report: dict[str, Any]) -> str:
    """The report as text: the set-up, per budget the pools and their share of it, per rate the realised
    rate, whether the point proves rates, its regime, and both variants (means ±95 % intervals over
    trials) -- latencies and goodput, then memory: KV blocks at peak, waits for memory, preemptions and
    recomputed tokens, peak in flight, idle steps -- the answer, the crossover, the layers' gather
    against compute."""
    s = report["sizing"]
    variants = report["variants"]
    lines = [f"wsharding bench serve -- {report['mode']}, {report['world_size']} ranks"
             + (f" ({report['ranks_per_device']} per GPU, time-sliced)" if report["ranks_per_device"] > 1
                and report["device"] != "cpu" else "")
             + f", {report['preset']} ({report['layers']} layers), gathers by {report['communicator']}"]
    lines += [f"  NOTE: {n}" for n in report["notes"]]
    lines.append(f"  workload: {report['workload_text']}; {report['trials']} trial(s) per point, the first "
                 f"{report['warmup_requests']} requests per rank left out (warm-up)")
    lines.append("  judged as a pair: the variants serve the same arrivals (rescaled to the rate), interleaved per "
                 "trial, the first alternating; goodput over the arrival window of the measured requests, common "
                 "to both; replicated ranks run free, sharded ranks aligned (their idle steps counted)")
    lines.append(f"  steps: at most {report['token_budget']} tokens (chunked prefill, admission by the chunk's blocks), "
                 f"padded to the next power of two; each sequence attends over its own context, padded likewise "
                 f"(<= {report['max_context']}; sequences grouped by that bucket); KV in blocks of {BLOCK_TOKENS}, {report['kv_bytes_per_token']:,} B per "
                 "token" + (f"; at most {report['max_concurrency']} requests in flight" if report.get("max_concurrency") else ""))
    lines += graphs_line(report)
    lines.append("  resident: " + ", ".join(f"{v} {_mib(s[v]['resident_bytes'])}" for v in variants)
                 + f"; reserve for activations {_mib(s['replicated']['reserve_bytes'])}")
    lines.append(f"  SLO: {report['slo_text'] or 'none given (no goodput)'}")
    head = (f"    {'':<18}{'req/s':>12}{'out tok/s':>14}{'TTFT mean/p99':>17}{'TPOT mean/p99':>16}"
            f"{'ITL p99':>10}{'E2E p50/p99':>22}{'goodput':>13}{'met':>6}")
    mem = (f"    {'':<18}{'KV peak/pool':>16}{'waited':>10}{'preempt':>10}{'recomputed':>14}{'in flight':>11}"
           f"{'idle steps':>12}{'drain':>8}")
    for row in report["rows_by_budget"]:
        spec = row["budget_spec"]
        how = ("" if "bytes" in spec else f" (replicated KV share {spec['kv_share']:.0%})" if "kv_share" in spec
               else f" ({spec['utilization']:.0%} of {_mib(spec.get('memory_bytes') or report['device_memory_bytes'])})")
        lines.append(f"  budget {_mib(row['budget_bytes'])} per rank{how}: KV pool "
                     + ", ".join(f"{v} {row[v]['pool_tokens']:,} tokens = {row[v]['kv_share']:.1%} of the budget"
                                 for v in variants)
                     + "; cost model: " + ", ".join(f"{v} {row['predicted'][v]['pool_tokens']:,}" for v in variants[1:]))
        lines += graphs_lines(report, row)
        a = row["answer"]
        for p, ok, reg in zip(row["points"], a["steady"], a["regime"], strict=True):
            real = p["realised_rate"]["mean"]
            lines.append(f"   rate {rate_label(p['rate'])} per rank"
                         + ("" if real is None else f" (realised {real:.3f}/s)") + f": {reg}"
                         + ("" if ok else "; NOT A STEADY STATE: a variant met the SLO while most of its time measured "
                            "was the drain after the last arrival -- the point proves no rate (more --requests)"))
            lines.append(head)
            for v in variants:
                x = p[v]
                good = _iv(x.get("goodput"), ".2f") if "goodput" in x else "-"
                met = f"{x['attainment']['mean']:.0%}" if "attainment" in x else "-"
                lines.append(f"    {v:<18}{_iv(x['request_throughput'], '.2f'):>12}{_iv(x['output_throughput']):>14}"
                             f"{_v(x['ttft_ms']['mean']['mean']) + '/' + _v(x['ttft_ms']['p99']['mean']):>17}"
                             f"{_v(x['tpot_ms']['mean']['mean']) + '/' + _v(x['tpot_ms']['p99']['mean']):>16}"
                             f"{_v(x['itl_ms']['p99']['mean']):>10}"
                             f"{_v(x['e2e_ms']['p50']['mean']) + '/' + _v(x['e2e_ms']['p99']['mean']):>22}"
                             f"{good:>13}{met:>6}")
            lines.append(mem)
            for v in variants:
                x = p[v]
                lines.append(f"    {v:<18}{_iv(x['peak_blocks'], '.0f') + '/' + str(row[v]['pool_blocks']):>16}"
                             f"{_iv(x['waited_for_memory'], '.0f'):>10}{_iv(x['preemptions'], '.0f'):>10}"
                             f"{_iv(x['recomputed_tokens'], ',.0f'):>14}{_iv(x['peak_in_flight'], '.0f'):>11}"
                             f"{_iv(x['idle_steps'], ',.0f'):>12}{_v(x['drain_share']['mean'], '.0%'):>8}")
        lines.append(f"   ANSWER: {answer_text(row, variants)}")
    if report.get("crossover"):
        lines.append("  CROSSOVER (ratio of sustained rates against the pool ratio; the cost model's line is pool "
                     "ratio / step-time ratio where the replicated pool limits, 1 / step-time ratio where compute does):")
        lines += crossover_text(report["crossover"])
    lines.append(design_line(design_kv_capacity()))
    lines += _layer_lines(report)
    own = report["own_schedule_differ"]
    if report["equal"]:
        lines.append("  tokens: the sharded model replayed the replicated run's steps, every token equal"
                     + (f"; in its own steps {own['requests']} of {own['of']} requests parted where logits of two "
                        "bucket shapes nearly tie (expected: another shape, other last bits)" if own["requests"] else
                        "; its own steps gave the same tokens too"))
    elif not report.get("checked"):
        lines.append("  tokens: NOT CHECKED (--no-check)")
    else:
        lines.append("  TOKENS DIFFER in the replay: " + "; ".join(
            f"rank {d['rank']} requests {d['requests']} at budget {_mib(d['budget_bytes'])}, rate {rate_label(d['rate'])}"
            for d in report["differ"]))
    return "\n".join(lines)


def design_kv_capacity() -> dict[str, int | None]:
    """The cost model's KV capacity per GPU, replicated vs sharded, for :data:`DESIGN_PRESET` on
    :data:`DESIGN_RANKS` :data:`DESIGN_DEVICE` GPUs: what the measured pools stand for at full size."""
    from wsharding.costmodel import Deployment, estimate
    from wsharding.presets import load_preset

    dep = Deployment(ranks=DESIGN_RANKS, device=get_device(DESIGN_DEVICE), tokens=256)
    return estimate(load_preset(DESIGN_PRESET), dep).kv_capacity()


def design_line(cap: dict[str, int | None]) -> str:
    """One line: the prediction for the design's scale, labelled as one (nothing here measured it)."""
    rep, sh = cap["tokens_replicated"], cap["tokens_sharded"]
    return (f"  PREDICTED, not measured (cost model, {DESIGN_PRESET} on {DESIGN_RANKS} x {DESIGN_DEVICE.upper()}, "
            f"a {cap['pool_bytes_replicated'] / 2**30:.0f} GiB replicated KV pool assumed): KV tokens per GPU "
            f"replicated {rep:,} -> sharded {sh:,} ({sh / rep:.2f}x)")


def _layer_lines(report: dict[str, Any]) -> list[str]:
    lts = [lt for lt in report["layer_times"] if lt["gather_us"]]
    if not lts:
        return []
    lines = [f"  per sharded layer (median over layers, rank 0), measured vs the cost model on {PREDICT_ON.upper()}'s "
             f"datasheet with {report['world_size']} GPUs:"]
    for n in sorted({lt["tokens"] for lt in lts}):
        at = [lt for lt in lts if lt["tokens"] == n]
        med = {k: statistics.median(lt[k] for lt in at) for k in ("gather_us", "compute_us", "predicted_gather_us",
                                                                  "predicted_compute_us", "predicted_hide_tokens")}
        lines.append(f"    {n:>5} tokens x {at[0]['width']} context: gather {med['gather_us']:,.0f} us, compute "
                     f"{med['compute_us']:,.0f} us (predicted {med['predicted_gather_us']:,.1f} / "
                     f"{med['predicted_compute_us']:,.1f} us; the gather hides from {med['predicted_hide_tokens']:,.0f} "
                     "tokens per step)")
    return lines


def with_answers(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with every answer and the crossover computed again from its points (a saved file's
    own answers are never read: they could say anything)."""
    slo = None if report.get("slo") is None else SLO(**report["slo"])
    for row in report["rows_by_budget"]:
        row["answer"] = answer(row, report["rates"], report["variants"], slo)
    report["crossover"] = crossover(report["rows_by_budget"], report["variants"])
    return report


def read_serve_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A report ``wsharding bench serve --json`` saved, read back: a regular file of at most the
    report limit, JSON without NaN or infinities, nested no deeper than a report is, a serve report of
    this schema whose every figure read is there, of its type and in its range (:func:`check_report`);
    then its answers computed again (:func:`with_answers`)."""
    report = parse_report(read_saved_report_text(path), path)
    check_report(report, path)
    return with_answers(report)


def read_saved_report_text(path: str | os.PathLike[str]) -> str:
    """The text of a saved report (:func:`~wsharding.io_checks.read_regular_file`, the report limit)."""
    from wsharding.io_checks import MAX_REPORT_BYTES, read_regular_file

    raw = read_regular_file(path, "saved report", max_bytes=MAX_REPORT_BYTES,
                            todo="pass a JSON report a wsharding command wrote")
    return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw


#: What reports merged into one must share (:func:`merge_saved`): the same set-up, other budgets.
SAME_SETUP = ("preset", "layers", "world_size", "variants", "rates", "trials", "slo", "workload_text", "token_budget",
              "device", "mode", "warmup_requests", "graphs")


def merge_saved(reports: list[dict[str, Any]], paths: list[Any]) -> dict[str, Any]:
    """Saved reports of one set-up at other budgets (one call per budget where a call's time is
    limited) as one report: their budgets side by side, ordered by the replicated pool's share, the
    answers and the crossover computed again. Reports of another set-up are refused, naming the field."""
    first = reports[0]
    for r, path in zip(reports[1:], paths[1:], strict=True):
        for key in SAME_SETUP:
            if r.get(key) != first.get(key):
                raise InvalidArgument(f"{path}: its {key} differs from {paths[0]}'s: only runs of one set-up at other "
                                      "budgets merge into one report")
    merged = dict(first)
    rows = [row for r in reports for row in r["rows_by_budget"]]
    rows.sort(key=lambda row: row["replicated"]["kv_share"])
    merged["rows_by_budget"] = rows
    merged["budgets"] = [row["budget_bytes"] for row in rows]
    merged["differ"] = [d for r in reports for d in r["differ"]]
    merged["equal"] = all(r["equal"] for r in reports)
    merged["requests"] = [q for r in reports for q in r.get("requests", [])]
    own = [r["own_schedule_differ"] for r in reports]
    merged["own_schedule_differ"] = {"requests": sum(o["requests"] for o in own), "of": sum(o["of"] for o in own)}
    return with_answers(merged)
