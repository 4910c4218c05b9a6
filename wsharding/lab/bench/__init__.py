"""``wsharding bench``: measured benchmarks, one module per benchmark.

Each benchmark's options are in :mod:`wsharding.lab.args` (``add_arguments(parser)``, no torch) and it runs in
its own module (``main(args) -> int``), imported once the arguments are parsed; adding one is a row in
:data:`BENCHES` (e.g. ``"step": ("wsharding.lab.args.bench_step", "wsharding.lab.bench.step", "...")``).
"""

from __future__ import annotations

import argparse
import importlib

from wsharding.lab.cliargs import add_verbose_option

#: benchmark name -> (module of its options, module that runs it, one-line help)
BENCHES: dict[str, tuple[str, str, str]] = {
    "allgather": (
        "wsharding.lab.args.bench_allgather", "wsharding.lab.bench.allgather",
        "per-layer AllGather: copy engine (CTA policy 2) vs SM kernels (policy 0) vs torch.distributed",
    ),
    "step": (
        "wsharding.lab.args.bench_step", "wsharding.lab.bench.step",
        "step time: replicated vs weight-sharded (lookahead on/off) vs FSDP2, across tokens per rank",
    ),
    "schedule": (
        "wsharding.lab.args.bench_schedule", "wsharding.lab.bench.schedule",
        "lookahead depth 1 vs 2 vs 3 (prefetch_depth) side by side, resident bytes against the formula, and "
        "the host cost of the check at use",
    ),
    "load": (
        "wsharding.lab.args.bench_load", "wsharding.lab.bench.load",
        "the start-up peak of load_sharded per rank: a model built with its weights vs built on meta, beside "
        "the bound R/N + slots + rest + one weight; a forward's peak above the steady state",
    ),
    "draft": (
        "wsharding.lab.args.bench_draft", "wsharding.lab.bench.draft",
        "draft model, layer 0: exposed gather time with a dedicated stream vs the shared side stream vs inline",
    ),
    "profile": (
        "wsharding.lab.args.bench_profile", "wsharding.lab.bench.profile",
        "one sharded decoder step under torch.profiler: the intervals of every stream (threads on CPU ranks)",
    ),
    "serve": (
        "wsharding.lab.args.bench_serve", "wsharding.lab.bench.serve",
        "what the saving buys: a stream of requests under one memory budget, replicated vs sharded "
        "(KV pool, concurrency, tokens/s, TTFT, TPOT)",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (options, module, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(options).add_arguments(p)
        add_verbose_option(p)
        p.set_defaults(_bench_module=module)


def main(args: argparse.Namespace) -> int:
    """Run the parsed benchmark: its module (torch with it) is imported here, after parsing."""
    return int(importlib.import_module(args._bench_module).main(args) or 0)
