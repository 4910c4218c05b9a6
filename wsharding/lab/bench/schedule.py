"""``wsharding bench schedule``: lookahead depth 1 against 2 and 3 in one run, and what the check at use costs.

Per depth ``k`` the same model is sharded with ``prefetch_depth=k`` (``k + 1`` slots) on every rank, and
the steps of all depths are timed in rounds of rotating order (:mod:`wsharding.lab.bench.rounds`), so
that each ratio compares steps measured side by side. Each depth's output is compared bit for bit with
the replicated model's, and its resident bytes with the formula ``R/N + (k+1) max|T_l|``.

The check at use ([Note: checked at use] in ``wsharding/core/step_owner.py``) is timed on the host where a
layer pays it: ``planner.ensure(layer)`` on a layer whose slot holds it (what every target linear and
every block of ours calls at its start; ``block_start`` makes the same test), the median of many calls;
beside it the planner's whole host time per layer of a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.units import MiB
from wsharding.lab.args.bench_schedule import add_arguments as add_arguments
from wsharding.lab.bench.ranks import auto_comm, bench_cluster
from wsharding.lab.bench.report import json_path
from wsharding.lab.bench.rounds import round_orders
from wsharding.lab.bench.step import check_cost_us, sharded_twin, timed_steps
from wsharding.lab.cliargs import check_output_path
from wsharding.models import build_pair, decoder_config
from wsharding.models.blocks import BLOCK_PRESETS, build_blocks
from wsharding.runtime import gpu_count, in_ci


def schedule_bench_rank(ctx: RankContext, model: str, tokens: list[int], depths: list[int], *, steps: int = 5,
                        repeats: int = 3, comm: str = "auto") -> dict[str, Any]:
    """On one rank: every depth at every tokens-per-rank value, timed in rotating rounds."""
    c = shard_comm_for(ctx, comm)
    dev = c.device
    if model in BLOCK_PRESETS:
        replicated = build_blocks(model, dev)

        def make_input(n: int, seed: int) -> torch.Tensor:
            return replicated.inputs(n, seed, dev)
    else:
        cfg = decoder_config(model)
        replicated = build_pair(cfg, c)[0]

        def make_input(n: int, seed: int) -> torch.Tensor:
            return torch.randint(0, cfg.vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(dev)
    twins = {k: sharded_twin(model, c, prefetch_depth=k) for k in depths}
    memory = {k: {"resident_bytes": ws.resident_bytes(), "formula_bytes": ws.formula_bytes(),
                  "slots": ws.slots.count, "replicated_bytes": ws.replicated_bytes()} for k, (_, ws) in twins.items()}
    costs = check_cost_us(twins[depths[0]][1])
    rows = []
    names = [f"depth {k}" for k in depths]
    with torch.no_grad():
        for n in tokens:
            x = make_input(n, seed=n)
            want = replicated(x)
            runs = {f"depth {k}": (lambda m=m, x=x: m(x)) for k, (m, _) in twins.items()}
            equal = {name: bool(torch.equal(run(), want)) for name, run in runs.items()}
            samples: dict[str, list[float]] = {name: [] for name in names}
            for order in round_orders(names, repeats):
                for name in order:
                    runs[name]()  # one warm step before each measurement of another sharding
                    samples[name].append(timed_steps(runs[name], steps, dev)[0])
            rows.append({"tokens": n, "ms": samples, "equal": equal,
                         "misses": {f"depth {k}": ws.planner.misses for k, (_, ws) in twins.items()}})
    for _, ws in twins.values():
        ws.close()
    return {"rank": ctx.rank, "mode": c.mode, "emulation": c.emulation or ctx.emulation, "memory": memory,
            "check": costs, "rows": rows, "depths": depths}


def summarize(results: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """The slowest rank's median per depth and tokens value, ratios to depth 1 (or the first depth)."""
    r0 = results[0]
    base = f"depth {r0['depths'][0]}"
    rows = []
    for i, row in enumerate(r0["rows"]):
        med = {name: max(statistics.median(r["rows"][i]["ms"][name]) for r in results) for name in row["ms"]}
        rows.append({"tokens": row["tokens"], "ms": med, "vs_first": {n: med[n] / med[base] for n in med},
                     "equal": all(all(r["rows"][i]["equal"].values()) for r in results),
                     "misses": max(max(r["rows"][i]["misses"].values()) for r in results)})
    return {"model": model, "world_size": len(results), "mode": r0["mode"], "emulation": r0["emulation"],
            "depths": r0["depths"], "memory": r0["memory"], "rows": rows,
            "check_ensure_us": max(r["check"]["ensure_us"] for r in results),
            "planner_us_per_layer": max(r["check"]["planner_us_per_layer"] for r in results)}


def format_table(report: dict[str, Any]) -> str:
    depths = report["depths"]
    names = [f"depth {k}" for k in depths]
    lines = [f"wsharding bench schedule -- {report['model']}, {report['world_size']} ranks, mode {report['mode']}"]
    if report["emulation"]:
        note = report["emulation"]
        lines.append(f"  NOTE: {note if note.startswith('emulated') else 'emulated: ' + note}")
    lines.append("  ms per step (slowest rank's median), and against " + names[0] + ":")
    lines.append("  tokens/rank | " + " | ".join(f"{n:>16}" for n in names) + " | outputs equal")
    for row in report["rows"]:
        cells = [f"{row['ms'][n]:8.3f} ({row['vs_first'][n]:.2f}x)" for n in names]
        lines.append(f"  {row['tokens']:>11} | " + " | ".join(f"{c:>16}" for c in cells)
                     + f" | {'yes' if row['equal'] else 'NO'}")
    lines.append("  resident per rank: measured / formula R/N + (k+1) max|T_l|:")
    for k in depths:
        m = report["memory"].get(str(k)) or report["memory"][k]  # a JSON round trip makes the keys str
        lines.append(f"    depth {k} ({m['slots']} slots): {m['resident_bytes'] / MiB:.3f} / "
                     f"{m['formula_bytes'] / MiB:.3f} MiB ({'equal' if m['resident_bytes'] == m['formula_bytes'] else 'DIFFERENT'})"
                     f", replicated {m['replicated_bytes'] / MiB:.3f} MiB")
    lines.append(f"  check at use, host per call: {report['check_ensure_us']:.3f} us (ensure of a layer its slot "
                 f"holds); the planner's whole step, per layer: {report['planner_us_per_layer']:.2f} us")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    check_output_path(str(json_path(args.json)) if args.json else "", "--json")
    gpus = gpu_count()
    n = args.ranks or (gpus if gpus else 2)
    model = args.model or ("llama8b-blocks" if gpus and not in_ci() else "tiny-blocks")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1, 16, 256, 2048] if gpus else [1, 16, 256])
    depths = [int(d) for d in args.depths.split(",")]
    if len(set(depths)) != len(depths):
        print(f"wsharding bench schedule: error: --depths lists a depth twice: {args.depths}", file=sys.stderr)
        return 2
    with bench_cluster(n, task_timeout=3600) as cluster:
        results = cluster.run(schedule_bench_rank, model, tokens, depths, steps=args.steps or (20 if gpus else 5),
                              repeats=args.repeats or (5 if gpus else 3), comm=auto_comm(args.comm))
    report = summarize(results, model)
    print(format_table(report))
    if args.json:
        out = json_path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"  wrote {out}")
    return 0
