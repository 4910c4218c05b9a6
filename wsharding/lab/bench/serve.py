"""``wsharding bench serve``: what the saving buys -- the same requests served replicated and sharded
under the same memory budget per rank.

Each rank gets the budget and its own seeded requests (DP attention). Each variant sizes its KV pool
from what the budget leaves after its weights (slots included) and a stated reserve for activations,
admits requests while their KV fits (continuous batching), and decodes greedily; see
:mod:`wsharding.serve`. Reported per budget and variant: the KV pool, concurrent sequences, output
tokens per step and per second, TTFT and TPOT, requests that waited for memory, the load peak; the
ratios sharded / replicated; the cost model's KV pool for the same budget; per layer the gather time
against the compute time. Every request's tokens must be the same in both variants: a difference
fails the run, naming the request and rank.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

from wsharding.cluster import RankCluster
from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.lab.bench.ranks import auto_comm, bench_cluster
from wsharding.lab.bench.report import save_report
from wsharding.lab.cliargs import check_output_path, checked_number, int_at_least, number_list
from wsharding.lab.outdir import default_help, default_output
from wsharding.lab.tasks.serve import serve_rank
from wsharding.models import PRESETS
from wsharding.runtime import gpu_count
from wsharding.serve import Workload, activation_reserve_bytes, pool_tokens
from wsharding.serve.engine import percentile

#: Share of the workload's whole KV demand per rank that the default emulated budgets leave for the
#: replicated model's pool: a quarter and a half (the pool limits it) and one and a half (room to spare).
CPU_BUDGET_SHARES = (0.25, 0.5, 1.5)

RATIO_KEYS = ("pool_tokens", "max_concurrency", "mean_concurrency", "tokens_per_step", "tokens_per_s",
              "ttft_ms_median", "tpot_ms_median")


class ServeMismatch(WshardingError, AssertionError):
    """A request's generated tokens differ between the replicated and the sharded model."""


def replicated_footprint(preset: str, layers: int | None, rows: int, workload: Workload) -> dict[str, int]:
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
    return {"resident_bytes": model_bytes(model), "reserve_bytes": activation_reserve_bytes(model, rows, workload.max_len),
            "demand_bytes": demand, "kv_bytes_per_token": per_token}


def default_cpu_budgets(preset: str, layers: int | None, rows: int, workload: Workload) -> list[int]:
    """Emulated budgets for CPU ranks: the replicated model, its reserve, and room for
    :data:`CPU_BUDGET_SHARES` of the workload's KV demand."""
    f = replicated_footprint(preset, layers, rows, workload)
    return [f["resident_bytes"] + f["reserve_bytes"] + kv_room(f, share, workload) for share in CPU_BUDGET_SHARES]


def kv_room(footprint: dict[str, int], share: float, workload: Workload) -> int:
    """KV bytes for ``share`` of one rank's demand, but never less than the longest request the
    workload can draw needs (a smaller pool would refuse it)."""
    longest = (workload.max_len + 1) * footprint["kv_bytes_per_token"]  # +1: the pool's scratch row
    return max(int(share * footprint["demand_bytes"]), longest)


def _merged(results: list[dict[str, Any]], variant: str, i: int) -> dict[str, Any]:
    """One variant at budget ``i``, over every rank: sums and means per rank, latencies over all requests."""
    runs = [r["runs"][variant][i] for r in results]
    ttft = [1e3 * x for r in runs for x in r["ttft_s"]]
    tpot = [1e3 * x for r in runs for x in r["tpot_s"]]
    return {
        "pool_tokens": min(r["pool_tokens"] for r in runs),
        "pool_bytes": runs[0]["pool_bytes"],
        "max_concurrency": max(r["max_concurrency"] for r in runs),
        "mean_concurrency": statistics.fmean(r["mean_concurrency"] for r in runs),
        "tokens_per_step": statistics.fmean(r["tokens_per_step"] for r in runs),
        "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in runs),
        "steps": max(r["steps"] for r in runs),
        "wall_s": max(r["wall_s"] for r in runs),
        "ttft_ms_median": statistics.median(ttft) if ttft else None, "ttft_ms_p99": percentile(ttft, 99),
        "tpot_ms_median": statistics.median(tpot) if tpot else None, "tpot_ms_p99": percentile(tpot, 99),
        "waited_for_memory": sum(r["waited_for_memory"] for r in runs),
        "waited_for_rows": sum(r["waited_for_rows"] for r in runs),
        "peak_kv_tokens": max(r["peak_kv_tokens"] for r in runs),
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's report from every rank's :func:`~wsharding.lab.tasks.serve.serve_rank` result."""
    r0 = results[0]
    sizing = r0["sizing"]
    per_token = r0["kv_bytes_per_token"]
    mean_request = statistics.fmean(r["kv_tokens_mean"] for r in results)
    variants = list(r0["runs"])  # replicated first, then the sharded ones
    requests = r0["workload"]["requests"]
    rows = []
    for i, budget in enumerate(r0["budgets"]):
        row: dict[str, Any] = {"budget_bytes": budget, **{v: _merged(results, v, i) for v in variants}}
        rep = row["replicated"]
        row["ratio"] = {v: {k: row[v][k] / rep[k] for k in RATIO_KEYS if row[v][k] is not None and rep[k]}
                        for v in variants[1:]}
        # The cost model's pool: the replicated model's resident bytes less the bill's net saving.
        row["predicted"] = {"replicated": {"pool_tokens": rep["pool_tokens"]}}
        for v in variants[1:]:
            resident = sizing["replicated"]["resident_bytes"] - sizing[v]["net_saving_bytes_predicted"]
            try:
                tokens = pool_tokens(budget, resident, sizing[v]["reserve_bytes"], per_token)
            except WshardingError:
                tokens = 0
            row["predicted"][v] = {"pool_tokens": tokens}
        for p in row["predicted"].values():
            p["concurrency"] = min(requests, int(p["pool_tokens"] // mean_request))
        rows.append(row)
    differ = [{"rank": r["rank"], "budget_bytes": r0["budgets"][i], "requests": ids}
              for r in results for i, ids in enumerate(r["differ"]) if ids]
    layer_times = [{"layer": lt["layer"], "gather_us": max((r["sizing"]["sharded"]["layer_times"][j]["gather_us"] or 0.0)
                                                           for r in results),
                    "compute_us": max((r["sizing"]["sharded"]["layer_times"][j]["compute_us"] or 0.0) for r in results)}
                   for j, lt in enumerate(sizing["sharded"]["layer_times"])]
    keep = ("mode", "emulation", "device", "communicator", "world_size", "ranks_per_device", "preset", "layers",
            "rows", "max_len", "workload", "workload_text", "kv_bytes_per_token")
    return {"bench": "serve", "date": time.strftime("%Y-%m-%d"), **{k: r0[k] for k in keep}, "mean_request_kv_tokens": mean_request, "variants": variants,
            "sizing": {v: {k: x for k, x in sizing[v].items() if k != "layer_times"} for v in variants},
            "layer_times": layer_times, "rows_by_budget": rows, "differ": differ, "equal": not differ}


def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f} MiB" if b < 100 * 2**20 else f"{b / 2**20:,.1f} MiB"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def format_table(report: dict[str, Any]) -> str:
    """The report as text: the set-up, then per budget both variants and their ratio."""
    s = report["sizing"]
    lines = [f"wsharding bench serve -- {report['mode']}, {report['world_size']} ranks"
             + (f" ({report['ranks_per_device']} per GPU, time-sliced)" if report["ranks_per_device"] > 1
                and report["device"] != "cpu" else "")
             + f", {report['preset']} ({report['layers']} layers), gathers by {report['communicator']}"]
    if report["emulation"]:
        lines.append(f"  NOTE: {report['emulation']}")
    if report["device"] == "cpu":
        lines.append("  NOTE: the budgets are emulated (a number per rank, not the machine's memory); times are CPU "
                     "times, concurrency and tokens per step exact counts")
    elif report["ranks_per_device"] > 1:
        lines.append("  NOTE: time-sliced -- the ranks share one GPU, so a gather is a copy inside it, not over a link, "
                     "and the ranks' steps take turns")
    lines.append(f"  workload: {report['workload_text']}")
    lines.append(f"  steps of {report['rows']} rows, attention over {report['max_len']} tokens; "
                 f"KV {report['kv_bytes_per_token']:,} B per token")
    variants = report["variants"]
    lines.append("  resident: " + ", ".join(f"{v} {_mib(s[v]['resident_bytes'])}" for v in variants)
                 + f"; reserve for activations {_mib(s['replicated']['reserve_bytes'])}; load peak "
                 + ", ".join(f"{v} {_mib(s[v]['load_peak_bytes'])}" for v in variants))
    for v in variants[1:]:
        lines.append(f"  {v}: {s[v]['slot_layout']}")
    head = (f"  {'':<20}{'KV pool':>12}{'max seq':>9}{'mean seq':>10}{'tok/step':>10}{'tok/s':>10}"
            f"{'TTFT med/p99 ms':>20}{'TPOT med/p99 ms':>20}{'waited mem/rows':>17}")
    for row in report["rows_by_budget"]:
        lines.append(f"  budget {_mib(row['budget_bytes'])} per rank:")
        lines.append(head)
        for v in variants:
            x = row[v]
            lines.append(f"  {v:<20}{x['pool_tokens']:>12,}{x['max_concurrency']:>9}{x['mean_concurrency']:>10.1f}"
                         f"{x['tokens_per_step']:>10.2f}{x['tokens_per_s']:>10.1f}"
                         f"{_ms(x['ttft_ms_median']) + ' / ' + _ms(x['ttft_ms_p99']):>20}"
                         f"{_ms(x['tpot_ms_median']) + ' / ' + _ms(x['tpot_ms_p99']):>20}"
                         f"{str(x['waited_for_memory']) + ' / ' + str(x['waited_for_rows']):>17}")
        for v in variants[1:]:
            r = row["ratio"][v]
            cells = [f"{r[k]:.2f}x" if k in r else "-" for k in RATIO_KEYS]
            lines.append(f"  {v + ' / rep':<20}{cells[0]:>12}{cells[1]:>9}{cells[2]:>10}{cells[3]:>10}{cells[4]:>10}"
                         f"{cells[5]:>20}{cells[6]:>20}")
        p = row["predicted"]
        lines.append("  cost model: pool " + ", ".join(f"{v} {p[v]['pool_tokens']:,} tokens (measured "
                                                        f"{row[v]['pool_tokens']:,})" for v in variants[1:])
                     + "; requests of the mean length at once: "
                     + ", ".join(f"{v} {p[v]['concurrency']}" for v in variants))
    gathers = [lt for lt in report["layer_times"] if lt["gather_us"]]
    if gathers:
        g = statistics.median(lt["gather_us"] for lt in gathers)
        c = statistics.median(lt["compute_us"] for lt in gathers)
        lines.append(f"  per sharded layer (median over layers, slowest rank): gather {g:,.0f} us, compute {c:,.0f} us,"
                     f" gather/compute {g / c:.2f}" if c else "")
    lines.append("  tokens: every request's tokens equal, replicated and sharded" if report["equal"] else
                 "  TOKENS DIFFER: " + "; ".join(f"rank {d['rank']} requests {d['requests']} at budget "
                                                 f"{_mib(d['budget_bytes'])}" for d in report["differ"]))
    return "\n".join(lines)


def run_serve_bench(ranks: int, preset: str, workload: Workload, *, budgets: list[int] | None = None,
                    rows: int = 64, reserve_bytes: int | None = None, comm: str = "auto", layers: int | None = None,
                    seed: int = 0, cluster: RankCluster | None = None) -> dict[str, Any]:
    """Run the serving benchmark on ``ranks`` ranks and return its report (:func:`summarize`).

    ``budgets``: bytes per rank; None -- on GPUs what each rank's GPU has free, on CPU ranks
    :func:`default_cpu_budgets`. ``cluster``: an open :class:`RankCluster` of ``ranks`` ranks to reuse.
    """
    gpus = gpu_count()
    if budgets is None:
        budgets = [None] if gpus else default_cpu_budgets(preset, layers, rows, workload)
    comm_name = auto_comm(comm)
    kwargs = {"workload": workload.as_dict(), "budgets": budgets, "rows": rows, "reserve_bytes": reserve_bytes,
              "comm": comm_name, "layers": layers, "seed": seed}
    if cluster is not None:
        if cluster.world_size != ranks:
            raise InvalidArgument(f"run_serve_bench: ranks={ranks}, but the cluster given has {cluster.world_size}")
        results = cluster.run(serve_rank, preset, **kwargs)
    else:
        with bench_cluster(ranks, task_timeout=3600) as c:
            results = c.run(serve_rank, preset, **kwargs)
    return summarize(results)


def _length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give LOW:HIGH tokens, e.g. 16:64") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LOW <= HIGH")
    return a, b


def _rate(text: str) -> float:
    """The argparse ``type`` of ``--rate``: a number, ``inf`` included (all at once, the default, as
    :class:`~wsharding.serve.workload.Workload` takes it). Whether it is > 0 is Workload's rule,
    answered in one line by :func:`~wsharding.lab.cliargs.run_command`."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of requests per second (inf: all at once)") from None
    if math.isnan(rate):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of requests per second (inf: all at once)")
    return rate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None,
                   help="ranks (default: every GPU -- two on a single GPU where NCCL >= 2.30 -- or 2 CPU ranks)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model (default k3-like on GPUs, tiny-deep on CPU)")
    p.add_argument("--layers", type=int_at_least(2), default=None, help="layers (default: the preset's)")
    p.add_argument("--budget-gib", type=number_list(float, 0.0, "GiB", "4,8,16"), default=None,
                   help="memory budget per rank, GiB; a comma list sweeps (default: what the GPU has free; on CPU "
                        "ranks three emulated budgets around the workload's KV demand)")
    p.add_argument("--budget-mib", type=number_list(float, 0.0, "MiB", "3,4,6"), default=None,
                   help="the same in MiB (for the small CPU models)")
    p.add_argument("--requests", type=int_at_least(1), default=None, help="requests per rank (default 64 on GPUs, 16 on CPU)")
    p.add_argument("--rate", type=_rate, default=math.inf,
                   help="Poisson arrivals, requests per second per rank, > 0 (default inf: all at once)")
    p.add_argument("--prompt", type=_length_range, default=None, help="prompt lengths LOW:HIGH, uniform (default 8:32 CPU, 64:256 GPU)")
    p.add_argument("--output", type=_length_range, default=None, help="output lengths LOW:HIGH, uniform (default 8:32 CPU, 64:256 GPU)")
    p.add_argument("--rows", type=int_at_least(1), default=None, help="rows per step: running sequences plus new prompt tokens "
                                                                       "(default 64 CPU, 512 GPU)")
    p.add_argument("--reserve-mib", type=checked_number(float, 0.0), default=None,
                   help="activation reserve per rank, MiB (default: the stated rule, activation_reserve_bytes)")
    p.add_argument("--comm", default="auto", choices=["auto", "torch", "nccl"],
                   help="gather with torch.distributed or our NCCL binding (auto: ours where it runs)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    out = default_output("bench_serve")
    p.add_argument("--json", default=out, metavar="PREFIX",
                   help=f"path prefix for .json and the figure ('' for none; {default_help(out)})")


def _figure(report: dict[str, Any]) -> Any:
    from wsharding.lab.viz.serve import serve_figure  # plotly: absent on the GPU machine

    return serve_figure(report)


def main(args: argparse.Namespace) -> int:
    check_output_path(args.json + ".json" if args.json else "", "--json")
    gpus = gpu_count()
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
    preset = args.preset or ("k3-like" if gpus else "tiny-deep")
    wl = Workload(requests=args.requests or (64 if gpus else 16), prompt=args.prompt or ((64, 256) if gpus else (8, 32)),
                  output=args.output or ((64, 256) if gpus else (8, 32)), rate=args.rate, seed=args.seed)
    budgets = None
    if args.budget_gib or args.budget_mib:
        budgets = [int(b * 2**30) for b in args.budget_gib or []] + [int(b * 2**20) for b in args.budget_mib or []]
    report = run_serve_bench(n, preset, wl, budgets=budgets, rows=args.rows or (512 if gpus else 64),
                             reserve_bytes=None if args.reserve_mib is None else int(args.reserve_mib * 2**20),
                             comm=args.comm, layers=args.layers, seed=args.seed)
    print(format_table(report))
    if args.json:
        save_report(report, args.json, _figure)
    if not report["equal"]:
        raise ServeMismatch("replicated and sharded generated different tokens: "
                            + "; ".join(f"rank {d['rank']} requests {d['requests']}" for d in report["differ"]))
    return 0
