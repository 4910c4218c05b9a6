"""The ``wsharding`` command: weight sharding for LLM inference, measured.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``main(args) -> int``; this file only wires them up. Bad input is answered in one line before any
work starts, and errors from the rank processes as one line per distinct error
(:mod:`wsharding.lab.cliargs`; ``--verbose`` adds the tracebacks).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from wsharding.lab.cliargs import OneLineParser, add_verbose_option, run_command

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("wsharding.lab.demo", "shard a model on N ranks, check it against the replicated one, report"),
    "plan": ("wsharding.lab.plan", "the memory and traffic bill of weight sharding for a preset or model file"),
    "info": ("wsharding.lab.info", "torch, CUDA, GPUs, the NCCL library and what it supports"),
    "bench": ("wsharding.lab.bench", "measured benchmarks (ratios measured side by side in one run)"),
    "soak": ("wsharding.lab.soak", "1000 steps checked bit for bit with no growth, and three fault runs that must not hang"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="wsharding", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        if name != "bench":  # bench adds it to each benchmark
            add_verbose_option(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        command = args.command + (f" {args.bench}" if getattr(args, "bench", None) else "")
        return run_command(command, args._main, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
