"""The options of ``wsharding bench profile`` (:mod:`wsharding.lab.bench.profile` runs it)."""

from __future__ import annotations

import argparse

from wsharding.lab.args.names import COMM_CHOICES, DECODER_PRESETS
from wsharding.lab.cliargs import int_at_least
from wsharding.lab.outdir import default_help, default_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None, help="ranks (default: all GPUs, or 2 CPU ranks)")
    p.add_argument("--preset", default=None, choices=DECODER_PRESETS,
                   help="decoder preset (default k3-like on GPUs, tiny on CPU)")
    p.add_argument("--tokens", type=int_at_least(1), default=8, help="tokens per rank per step (default 8)")
    p.add_argument("--steps", type=int_at_least(1), default=3,
                   help="profiled steps (default 3; the last is kept)")
    p.add_argument("--comm", default="auto", choices=COMM_CHOICES,
                   help="gather with torch.distributed or our NCCL binding (auto: ours where it runs)")
    out = default_output("bench_profile")
    p.add_argument("--json", default=out, metavar="PREFIX",
                   help=f"path prefix for .json and the figure ('' for none; {default_help(out)})")
