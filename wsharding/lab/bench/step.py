"""``wsharding bench step``: step time of the same model replicated, weight-sharded (lookahead on
and off) and under FSDP2 (``fully_shard``, the usual way to shard weights, here used for inference),
across tokens per rank, measured side by side in one run on the same ranks.

Ratios against the replicated model are what to read; absolute times on CPU ranks are emulated
(every row says so).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from wsharding.cluster import RankCluster, RankContext
from wsharding.models import PRESETS, ToyDecoder, build_pair, decoder_config
from wsharding.runtime import gpu_count, in_ci
from wsharding.units import ceil_div

VARIANTS = ("replicated", "sharded", "sharded_no_lookahead", "fsdp2")


def _fsdp2(cfg, ctx: RankContext, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = ToyDecoder(cfg, seed=0, device=device).eval()
    mesh = init_device_mesh(device.type, (ctx.world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    return model


def _timed(fn, steps: int, device: torch.device) -> float:
    """Mean milliseconds per call (CUDA events on GPU, perf_counter on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps * 1e3


def step_bench_rank(ctx: RankContext, preset: str, tokens: list[int], *, steps: int = 5, warmup: int = 2,
                    fsdp: bool = True) -> dict[str, Any]:
    """On one rank: the four variants at every tokens-per-rank value, in the same run."""
    cfg = decoder_config(preset)
    comm = ctx.shard_comm(ctx.world_size)
    dev = comm.device
    replicated, sharded = build_pair(cfg, comm)
    models = {"replicated": replicated, "sharded": sharded}
    if fsdp:
        models["fsdp2"] = _fsdp2(cfg, ctx, dev)
    planner = sharded.planner
    rows = []
    with torch.no_grad():
        for t in tokens:
            x = torch.randint(0, cfg.vocab, (t,), generator=torch.Generator().manual_seed(ctx.rank)).to(dev)
            row: dict[str, Any] = {"tokens_per_rank": t}
            for variant in VARIANTS:
                name = "sharded" if variant.startswith("sharded") else variant
                if name not in models:
                    continue
                planner.lookahead = variant != "sharded_no_lookahead"
                model = models[name]
                for _ in range(warmup):
                    model(x)
                comm.barrier()
                row[variant] = _timed(lambda m=model, x=x: m(x), steps, dev)
            planner.lookahead = True
            rows.append(row)
    return {"rank": ctx.rank, "mode": comm.mode, "emulation": ctx.emulation, "rows": rows,
            "replicated_bytes": sharded.weight_sharding.replicated_bytes(),
            "sharded_resident_bytes": sharded.weight_sharding.resident_bytes()}


def summarize(results: list[dict[str, Any]], preset: str) -> dict[str, Any]:
    """Per tokens value: the slowest rank's time per variant (a step ends when every rank ends)."""
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        merged = {"tokens_per_rank": row["tokens_per_rank"]}
        for v in VARIANTS:
            if v in row:
                merged[v] = max(r["rows"][i][v] for r in results)
        for v in VARIANTS[1:]:
            if v in merged:
                merged[f"{v}_vs_replicated"] = merged[v] / merged["replicated"]
        rows.append(merged)
    r0 = results[0]
    return {"bench": "step", "preset": preset, "mode": r0["mode"], "emulation": r0["emulation"],
            "world_size": len(results), "variants": [v for v in VARIANTS if v in rows[0]],
            "replicated_bytes_per_rank": r0["replicated_bytes"],
            "sharded_resident_bytes_per_rank": r0["sharded_resident_bytes"], "rows": rows}


def format_table(report: dict[str, Any]) -> str:
    head = f"wsharding bench step -- {report['mode']}, {report['world_size']} ranks, preset {report['preset']}"
    lines = [head] + ([f"  NOTE: {report['emulation']}"] if report["emulation"] else [])
    cols = [v for v in VARIANTS if v in report["rows"][0]]
    lines.append("  tokens/rank " + "".join(f"{c:>22}" for c in cols))
    for row in report["rows"]:
        cells = [f"{row['replicated']:9.3f} ms{'':11}"]
        cells += [f"{row[c]:9.3f} ms ({row[c + '_vs_replicated']:5.2f}x)" for c in cols[1:]]
        lines.append(f"  {row['tokens_per_rank']:>11} " + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=None, help="ranks (default: all GPUs, or 2 CPU ranks)")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="default: k3-like on GPUs, tiny on CPU")
    p.add_argument("--tokens", default=None, help="comma-separated tokens per rank (default 1,16,256,2048)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-fsdp", action="store_true", help="leave FSDP2 out")
    p.add_argument("--out", default="figures/bench_step", help="path prefix for .json and the figure ('' for none)")


def main(args: argparse.Namespace) -> int:
    gpus = gpu_count()
    backend = "nccl" if gpus else "gloo"
    n = args.ranks or (gpus if gpus else 2)
    preset = args.preset or ("k3-like" if gpus and not in_ci() else "tiny")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1, 16, 256] if not gpus else [1, 16, 256, 2048])
    with RankCluster(n, backend=backend, ranks_per_gpu=ceil_div(n, gpus) if gpus else 1, task_timeout=3600) as cluster:
        results = cluster.run(step_bench_rank, preset, tokens, steps=args.steps, fsdp=not args.no_fsdp)
    report = summarize(results, preset)
    print(format_table(report))
    if args.out:
        from wsharding.lab.viz.bench import step_figure
        from wsharding.lab.viz.export import save_figure

        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        for path in [str(out.with_suffix(".json")), *save_figure(step_figure(report), out)]:
            print(f"  wrote {path}")
    return 0
