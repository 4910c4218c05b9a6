"""The ``wsharding`` command: weight sharding for LLM inference, measured.

Each subcommand's options are in :mod:`wsharding.lab.args` (``add_arguments(parser)``, no torch) and it runs
in its own module (``main(args) -> int``), imported only once the arguments are parsed ([Note: the command
answers before torch loads]); this file only wires them up. Bad input is answered in one line before any
work starts, and errors from the rank processes as one line per distinct error
(:mod:`wsharding.lab.cliargs`; ``--verbose`` adds the tracebacks).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from wsharding.lab.cliargs import OneLineParser, add_verbose_option, run_command

#: subcommand -> (module of its options, module that runs it, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("wsharding.lab.args.demo", "wsharding.lab.demo",
             "shard a model on N ranks, check it against the replicated one, report"),
    "plan": ("wsharding.lab.args.plan", "wsharding.lab.plan",
             "the memory and traffic bill of weight sharding for a preset or model file"),
    "info": ("wsharding.lab.args.info", "wsharding.lab.info",
             "torch, CUDA, GPUs, the NCCL library and what it supports"),
    "bench": ("wsharding.lab.bench", "wsharding.lab.bench",
              "measured benchmarks (ratios measured side by side in one run)"),
    "soak": ("wsharding.lab.args.soak", "wsharding.lab.soak",
             "1000 steps checked bit for bit with no growth, and three fault runs that must not hang"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="wsharding", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (options, module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(options).add_arguments(p)
        if name != "bench":  # bench adds it to each benchmark
            add_verbose_option(p)
        p.set_defaults(_module=module)
    return parser


def run_main(args: argparse.Namespace) -> int:
    """Run the parsed command: the checks its options module makes from the arguments alone, then its
    module's ``main`` (imported here, torch with it)."""
    options = importlib.import_module(COMMANDS[args.command][0])
    if hasattr(options, "check_arguments"):
        options.check_arguments(args)
    return int(importlib.import_module(args._module).main(args) or 0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        command = args.command + (f" {args.bench}" if getattr(args, "bench", None) else "")
        return run_command(command, run_main, args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
