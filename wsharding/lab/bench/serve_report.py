"""The report of ``wsharding bench serve`` from every rank's result, and its text.

The headline (:func:`answer`) is the highest request rate each variant sustains within the SLOs and
the goodput ratio at every rate of the sweep, under a budget whose KV share is printed. A rate counts
only where the run was a steady state (:data:`~wsharding.serve.metrics.STEADY_DRAIN`): a point that
was mostly the drain after the last arrival is flagged, and the answer says where it stopped and why
("at least" when every rate tried passed). Beside it: per sharded layer, gather against compute at
the shapes the run used, with the cost model's prediction for the same layer on the GPUs of its
datasheet. :func:`read_serve_report` reads a saved report back and applies today's rules to it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections import defaultdict
from typing import Any

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.costmodel.devices import get_device
from wsharding.costmodel.plan import breakeven, gather_seconds
from wsharding.io_checks import read_saved_report
from wsharding.serve import BLOCK_TOKENS, pool_blocks
from wsharding.serve.metrics import (
    SLO,
    interval,
    is_steady,
    measured_window,
    over_trials,
    request_metrics,
    sweep_answer,
    trial_metrics,
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


def _point(results: list[dict[str, Any]], variant: str, b: int, ri: int, warmup: int, slo: SLO | None) -> dict[str, Any]:
    """One variant at one (budget, rate): the metrics of each trial, then their intervals and counts."""
    r0 = results[0]
    trials = []
    counts = {"max_concurrency": 0, "preemptions": 0, "steps": 0, "tokens_per_step": [], "mean_concurrency": []}
    by_bucket: dict[str, list[float]] = {}
    for t in range(r0["trials"]):
        key = f"{b}/{ri}/{t}"
        runs = [r["runs"][variant][key] for r in results]
        trials.append(trial_metrics([rec for run in runs for rec in run["records"]], len(results), warmup, slo))
        for run in runs:
            counts["max_concurrency"] = max(counts["max_concurrency"], run["max_concurrency"])
            counts["preemptions"] += run["preemptions"]
            counts["steps"] = max(counts["steps"], run["steps"])
            counts["tokens_per_step"].append(run["tokens_per_step"])
            counts["mean_concurrency"].append(run["mean_concurrency"])
            for k, c in run["steps_by_bucket"].items():
                acc = by_bucket.setdefault(k, [0, 0.0, 0])
                acc[0] += c["steps"]
                acc[1] += c["seconds"]
                acc[2] += c["working"]
    out = over_trials(trials)
    out.update(max_concurrency=counts["max_concurrency"], preemptions=counts["preemptions"], steps=counts["steps"],
               tokens_per_step=statistics.fmean(counts["tokens_per_step"]),
               mean_concurrency=statistics.fmean(counts["mean_concurrency"]),
               step_ms_by_bucket={k: {"steps": a[0], "working": a[2], "mean_ms": 1e3 * a[1] / a[0]}
                                  for k, a in sorted(by_bucket.items(), key=lambda x: int(x[0]))},
               trials=trials)
    return out


def _mean(point: dict[str, Any], key: str) -> float | None:
    return point[key]["mean"] if key in point else None


def steady(point: dict[str, Any], variant: str) -> bool:
    """Whether ``variant`` ran a steady state at this point of a report (:func:`~wsharding.serve.metrics.is_steady`)."""
    return is_steady(point["rate"], point[variant]["drain_share"]["mean"])


def answer(row: dict[str, Any], rates: list[float | None], variants: list[str], slo: SLO | None) -> dict[str, Any]:
    """The highest rate each variant sustains (:func:`~wsharding.serve.metrics.sweep_answer`
    over the steady points; all at once counts as infinite), where and why its sweep stopped
    (``stopped``: None when every rate tried passed, so the rate is a lower bound), and the goodput
    ratio of each sharded variant at each rate."""
    if slo is None:
        return {"max_rate": None, "goodput_ratio": None}
    xs = [math.inf if r is None else r for r in rates]
    best, stopped = {}, {}
    for v in variants:
        met = [_mean(p[v], "attainment") for p in row["points"]]
        best[v], stopped[v] = sweep_answer(xs, met, slo.attainment, [steady(p, v) for p in row["points"]])
        if stopped[v] is not None and math.isinf(stopped[v]["rate"]):
            stopped[v]["rate"] = None
    ratio = {}
    for v in variants[1:]:
        ratio[v] = []
        for p in row["points"]:
            rep, got = _mean(p["replicated"], "goodput"), _mean(p[v], "goodput")
            ratio[v].append(got / rep if rep else None)
    return {"max_rate": {v: (None if b is None else (None if math.isinf(b) else b)) for v, b in best.items()},
            "all_at_once_sustained": {v: b is not None and math.isinf(b) for v, b in best.items()},
            "stopped": stopped, "goodput_ratio": ratio}


def answer_text(row: dict[str, Any], variants: list[str]) -> str:
    """The answer as one sentence: per variant the highest rate sustained and where its sweep stopped
    and why, then the goodput ratio at each rate (the ANSWER line of :func:`format_table`)."""
    a = row["answer"]
    best = []
    for v in variants:
        stop = a["stopped"][v]
        if a["all_at_once_sustained"][v]:
            best.append(f"{v} all at once (a burst)")
            continue
        rate = f"{a['max_rate'][v]:g}/s" if a["max_rate"][v] is not None else (
            "not established" if stop and stop["why"] == "not a steady state" else "none of the rates")
        if stop is None:
            rate = f"at least {rate} (every rate tried)"
        else:
            rate += f" ({rate_label(stop['rate'])} {stop['why']})"
        best.append(f"{v} {rate}")
    ratios = "; ".join(f"{v}/replicated " + ", ".join(f"{rate_label(p['rate'])} {_v(g, '.2f')}x"
                                                       for p, g in zip(row["points"], a["goodput_ratio"][v], strict=True))
                       for v in variants[1:])
    return f"highest rate sustained within the SLO per rank: {'; '.join(best)}; goodput {ratios}"


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
            p: dict[str, Any] = {"rate": rate}
            for v in variants:
                p[v] = _point(results, v, b, ri, warmup, slo)
            row["points"].append(p)
        first = f"{b}/0/0"
        for v in variants:
            run = r0["runs"][v][first]
            row[v] = {"pool_tokens": min(r["runs"][v][first]["pool_tokens"] for r in results),
                      "pool_blocks": run["pool_blocks"], "pool_bytes": run["pool_bytes"],
                      "kv_share": run["pool_bytes"] / budget,
                      "max_concurrency": max(p[v]["max_concurrency"] for p in row["points"]),
                      "preemptions": sum(p[v]["preemptions"] for p in row["points"])}
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
    return {"bench": "serve", "schema": 2, "date": time.strftime("%Y-%m-%d"), **{k: r0.get(k) for k in keep},
            "workload": workload, "slo": None if slo is None else slo.as_dict(),
            "slo_text": None if slo is None else slo.describe(), "warmup_requests": warmup, "variants": variants,
            "sizing": sizing, "rows_by_budget": rows, "notes": notes(r0),
            "layer_times": predicted_layers(r0["layer_times"], r0["world_size"], itemsize) if r0["layer_times"] else [],
            "layer_times_by_rank": [r["layer_times"] for r in results],
            "requests": request_records(results, variants, slo, warmup),
            "differ": differ, "equal": not differ and bool(r0["checked"]),
            "own_schedule_differ": {"requests": own, "of": compared}}


def request_records(results: list[dict[str, Any]], variants: list[str], slo: SLO | None,
                    warmup: int) -> list[dict[str, Any]]:
    """Every request of every run, one flat record each: where it ran, its times and lengths, its
    latencies, whether it was measured and met the SLOs (the token times themselves stay on the ranks)."""
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


def check_schema(report: dict[str, Any]) -> None:
    """Refuse a report of the fixed-row benchmark that came before this one, by name."""
    if report.get("schema") != 2:
        raise InvalidArgument("this serve report was written by the earlier fixed-row benchmark (steps of a fixed "
                              "row count, a drain): re-run wsharding bench serve")


def format_table(report: dict[str, Any]) -> str:
    """The report as text: the set-up, per budget the pools and their share of it, per rate both
    variants (means ±95 % intervals over trials), the answer, the layers' gather against compute."""
    check_schema(report)
    s = report["sizing"]
    variants = report["variants"]
    lines = [f"wsharding bench serve -- {report['mode']}, {report['world_size']} ranks"
             + (f" ({report['ranks_per_device']} per GPU, time-sliced)" if report["ranks_per_device"] > 1
                and report["device"] != "cpu" else "")
             + f", {report['preset']} ({report['layers']} layers), gathers by {report['communicator']}"]
    lines += [f"  NOTE: {n}" for n in report["notes"]]
    lines.append(f"  workload: {report['workload_text']}; {report['trials']} trial(s) per point, the first "
                 f"{report['warmup_requests']} requests per rank left out (warm-up)")
    lines.append(f"  steps: at most {report['token_budget']} tokens (chunked prefill), padded to the next power of two; "
                 f"attention over the step's longest context, padded likewise (<= {report['max_context']}), "
                 f"each sequence's read once (a prefill chunk's too); KV in blocks "
                 f"of {BLOCK_TOKENS}, {report['kv_bytes_per_token']:,} B per token"
                 + (f"; at most {report['max_concurrency']} requests in flight" if report.get("max_concurrency") else ""))
    lines.append("  resident: " + ", ".join(f"{v} {_mib(s[v]['resident_bytes'])}" for v in variants)
                 + f"; reserve for activations {_mib(s['replicated']['reserve_bytes'])}")
    lines.append(f"  SLO: {report['slo_text'] or 'none given (no goodput)'}")
    head = (f"    {'':<18}{'req/s':>12}{'out tok/s':>14}{'TTFT mean/p99':>17}{'TPOT mean/p99':>16}"
            f"{'ITL p99':>10}{'E2E p50/p99':>22}{'goodput':>13}{'met':>6}{'seq':>5}{'preempt':>8}")
    for row in report["rows_by_budget"]:
        spec = row["budget_spec"]
        how = ("" if "bytes" in spec else f" (replicated KV share {spec['kv_share']:.0%})" if "kv_share" in spec
               else f" ({spec['utilization']:.0%} of {_mib(spec.get('memory_bytes') or report['device_memory_bytes'])})")
        lines.append(f"  budget {_mib(row['budget_bytes'])} per rank{how}: KV pool "
                     + ", ".join(f"{v} {row[v]['pool_tokens']:,} tokens = {row[v]['kv_share']:.1%} of the budget"
                                 for v in variants)
                     + "; cost model: " + ", ".join(f"{v} {row['predicted'][v]['pool_tokens']:,}" for v in variants[1:]))
        for p in row["points"]:
            drains = [v for v in variants if not steady(p, v)]
            lines.append(f"   rate {rate_label(p['rate'])} per rank:" + ("" if not drains else
                         " NOT A STEADY STATE for " + ", ".join(f"{v} (drain {p[v]['drain_share']['mean']:.0%} of the "
                                                                "time measured)" for v in drains)
                         + ": requests stopped arriving early, more --requests"))
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
                             f"{good:>13}{met:>6}{x['max_concurrency']:>5}{x['preemptions']:>8}")
        if row["answer"]["max_rate"] is not None:
            lines.append(f"   ANSWER: {answer_text(row, variants)}")
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


def with_todays_rules(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with each point's drain share (from its per-request records, as
    :func:`~wsharding.serve.metrics.trial_metrics` computes it, where a report saved before the rule
    lacks it) and each answer computed again under today's rules."""
    windows: dict[tuple, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for q in report["requests"]:
        if q["measured"]:
            sends, ends = windows[(q["budget"], q["rate"], q["variant"], q["trial"])]
            sends.append(q["sent_s"])
            ends.append(q["last_token_s"])
    slo = None if report.get("slo") is None else SLO(**report["slo"])
    for b, row in enumerate(report["rows_by_budget"]):
        for p in row["points"]:
            for v in report["variants"]:
                if "drain_share" not in p[v]:
                    p[v]["drain_share"] = interval(measured_window(*w)[2] for (bb, r, vv, _), w in windows.items()
                                                   if bb == b and r == p["rate"] and vv == v)
        row["answer"] = answer(row, report["rates"], report["variants"], slo)
    return report


def read_serve_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A report ``wsharding bench serve --json`` saved, read back (a regular file of at most the
    report limit, JSON, a serve report of this schema) with :func:`with_todays_rules` applied."""
    try:
        report = read_saved_report(path)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{path}: not JSON ({e}); pass the .json that wsharding bench serve --json wrote") from None
    if not isinstance(report, dict) or report.get("bench") != "serve":
        raise InvalidArgument(f"{path}: not a report of wsharding bench serve (its 'bench' field is not 'serve')")
    check_schema(report)
    return with_todays_rules(report)
