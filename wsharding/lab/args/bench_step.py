"""The options of ``wsharding bench step`` (:mod:`wsharding.lab.bench.step` runs it)."""

from __future__ import annotations

import argparse

from wsharding.lab.args.names import BLOCK_PRESETS, COMM_CHOICES, DECODER_PRESETS
from wsharding.lab.cliargs import checked_text, int_at_least, number_list
from wsharding.lab.outdir import default_help, default_output

#: The models ``--model`` names: the stacks of blocks, then the decoder presets.
MODELS = [*BLOCK_PRESETS, *DECODER_PRESETS]

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None, help="ranks (default: all GPUs, or 2 CPU ranks)")
    p.add_argument("--model", default=None, choices=MODELS,
                   help="default: llama8b-blocks on GPUs, tiny-blocks on CPU")
    p.add_argument("--comm", default="auto", choices=COMM_CHOICES,
                   help="gather with torch.distributed or our NCCL binding (auto: ours where it runs)")
    p.add_argument("--tokens", default=None, type=checked_text(number_list(int, 1, "tokens", "1,16,256")),
                   help="comma-separated tokens per rank (default 1,16,256,2048,8192 on GPUs, 1,16,256 on CPU)")
    p.add_argument("--steps", type=int_at_least(1), default=None, help="timed steps per measurement (default 20 GPU, 5 CPU)")
    p.add_argument("--repeats", type=int_at_least(1), default=None,
                   help="measurements per value, in rounds of rotating order (default 5 on GPUs: enough paired rounds "
                        "to tell lookahead from no lookahead at 90 %%; 3 on CPU ranks)")
    p.add_argument("--graph", action="store_true", help="also capture and replay the layer loop in a CUDA graph")
    p.add_argument("--no-fsdp", action="store_true", help="leave FSDP2 out")
    p.add_argument("--mapped", action="store_true",
                   help="also a sharding whose gathers copy nothing of their own (map_own_chunk; NCCL >= 2.30)")
    p.add_argument("--issue-thread", action="store_true",
                   help="also the variants whose gathers a native thread issues (our NCCL communicator)")
    out = default_output("bench_step")
    p.add_argument("--json", default=out, metavar="PREFIX",
                   help=f"path prefix for .json and the figure ('' for none; {default_help(out)})")
