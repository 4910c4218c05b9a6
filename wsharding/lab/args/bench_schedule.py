"""The options of ``wsharding bench schedule`` (:mod:`wsharding.lab.bench.schedule` runs it)."""

from __future__ import annotations

import argparse

from wsharding.lab.args.bench_step import MODELS
from wsharding.lab.args.names import COMM_CHOICES
from wsharding.lab.cliargs import checked_text, int_at_least, number_list
from wsharding.lab.outdir import default_help, default_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None, help="ranks (default: all GPUs, or 2 CPU ranks)")
    p.add_argument("--model", default=None, choices=MODELS, help="default: llama8b-blocks on GPUs, tiny-blocks on CPU")
    p.add_argument("--comm", default="auto", choices=COMM_CHOICES,
                   help="gather with torch.distributed or our NCCL binding (auto: ours where it runs)")
    p.add_argument("--tokens", default=None, type=checked_text(number_list(int, 1, "tokens", "1,16,256")),
                   help="comma-separated tokens per rank (default 1,16,256,2048 on GPUs, 1,16,256 on CPU)")
    p.add_argument("--depths", default="1,2,3", type=checked_text(number_list(int, 1, "depths", "1,2,3")),
                   help="lookahead depths to compare, the first is the reference (default 1,2,3)")
    p.add_argument("--steps", type=int_at_least(1), default=None, help="timed steps per measurement (default 20 GPU, 5 CPU)")
    p.add_argument("--repeats", type=int_at_least(1), default=None, help="rounds of rotating order (default 5 GPU, 3 CPU)")
    out = default_output("bench_schedule")
    p.add_argument("--json", default=out, metavar="PREFIX",
                   help=f"path prefix for .json ('' for none; {default_help(out)})")
