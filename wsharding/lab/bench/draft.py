"""``wsharding bench draft``: how much of the draft model's first-layer gather stays exposed.

A step is the target model's forward, a region that is not a layer (a labelled stand-in for the ~4 ms
commit step of SGLang's weight sharding for Kimi K3), and a 2-layer draft's forward whose first sharded
layer is gathered (see :mod:`wsharding.lab.tasks.draft`):

* ``dedicated``: prefetched on the planner's own stream after the target, under the region;
* ``shared``: prefetched on the stream the target's gathers use (the design saw ~25 us of overlap);
* ``inline``: not prefetched: gathered at the draft's start (a cold start), its whole time exposed.

Reported per mode: the median exposed time (compute-stream events around the wait) and step time,
slowest rank. On CPU ranks the same calls run on gloo (emulated; no streams, so no ``shared`` row).
"""

from __future__ import annotations

import argparse
from typing import Any

from wsharding.lab.args.bench_draft import MAX_COMMIT_MS as MAX_COMMIT_MS
from wsharding.lab.args.bench_draft import add_arguments as add_arguments
from wsharding.lab.bench.ranks import auto_comm, bench_cluster
from wsharding.lab.bench.report import json_path, save_report
from wsharding.lab.cliargs import check_output_path
from wsharding.lab.tasks.draft import draft_exposed
from wsharding.runtime import gpu_count, in_ci


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's report: per mode the slowest rank's median exposed time and step time."""
    r0 = results[0]
    rows = []
    for i, row in enumerate(r0["rows"]):
        per_rank = [r["rows"][i] for r in results]
        rows.append({"mode": row["mode"],
                     "exposed_us": max(x["exposed_us_median"] for x in per_rank),
                     "step_ms": max(x["step_ms_median"] for x in per_rank),
                     "exposed_us_per_rank": [x["exposed_us_median"] for x in per_rank]})
    keep = ("mode", "emulation", "communicator", "preset", "draft_layers", "first_layer_bytes", "region",
            "commit_ms", "tokens")
    return {"bench": "draft", "world_size": len(results), **{k: r0[k] for k in keep}, "rows": rows}


def format_table(report: dict[str, Any]) -> str:
    lines = [f"wsharding bench draft -- {report['mode']}, {report['world_size']} ranks, target {report['preset']}, "
             f"{report['draft_layers']}-layer draft, first layer |T| = {report['first_layer_bytes'] / 2**20:.2f} MiB, "
             f"gathers by {report['communicator']}"]
    if report["emulation"]:
        lines.append(f"  NOTE: {report['emulation']}")
    lines.append(f"  region between the models: {report['region']}")
    lines.append(f"  {'first-layer gather':<22}{'exposed (median)':>20}{'step (median)':>18}")
    for row in report["rows"]:
        lines.append(f"  {row['mode']:<22}{row['exposed_us']:>17.1f} us{row['step_ms']:>15.3f} ms")
    return "\n".join(lines)


def _figure(report: dict[str, Any]) -> Any:
    from wsharding.lab.viz.draft import draft_exposed_figure  # plotly: absent on the GPU machine

    return draft_exposed_figure(report)


def main(args: argparse.Namespace) -> int:
    check_output_path(str(json_path(args.json)) if args.json else "", "--json")
    gpus = gpu_count()
    n = args.ranks or (gpus if gpus else 2)
    preset = args.preset or ("k3-like" if gpus and not in_ci() else "tiny")
    with bench_cluster(n) as cluster:
        results = cluster.run(draft_exposed, preset, tokens=args.tokens, steps=args.steps, commit_ms=args.commit_ms,
                              comm=auto_comm(args.comm))
    report = summarize(results)
    print(format_table(report))
    if args.json:
        save_report(report, args.json, _figure)
    return 0
