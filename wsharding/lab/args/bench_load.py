"""The options of ``wsharding bench load`` (:mod:`wsharding.lab.bench.load` runs it)."""

from __future__ import annotations

import argparse

from wsharding.lab.args.names import BLOCK_PRESETS, COMM_CHOICES
from wsharding.lab.cliargs import int_at_least
from wsharding.lab.outdir import default_help, default_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None, help="ranks (default: all GPUs, or 2 CPU ranks)")
    p.add_argument("--model", default=None, choices=BLOCK_PRESETS,
                   help="default: llama8b-blocks on GPUs, tiny-blocks on CPU")
    p.add_argument("--comm", default="auto", choices=COMM_CHOICES,
                   help="gather with torch.distributed or our NCCL binding (auto: ours where it runs)")
    p.add_argument("--tokens", type=int_at_least(1), default=256, help="tokens per rank of the forward (default 256)")
    checkpoint = default_output("bench_load/{model}.safetensors")
    p.add_argument("--checkpoint", default=checkpoint,
                   help="where the checkpoint is written once and read ({model}: the model's name; "
                        f"{default_help(checkpoint)})")
    out = default_output("bench_load")
    p.add_argument("--json", default=out, metavar="PREFIX", help=f"path prefix for .json ('' for none; {default_help(out)})")
