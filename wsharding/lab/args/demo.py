"""The options of ``wsharding demo`` (:mod:`wsharding.lab.demo` runs it)."""

from __future__ import annotations

import argparse

from wsharding.lab.args.names import COMM_CHOICES, DECODER_PRESETS
from wsharding.lab.cliargs import MAX_CPU_RANKS, MAX_RANKS_PER_GPU, add_json_option, int_at_least, nonempty_path
from wsharding.lab.outdir import default_help, default_output


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None,
                   help=f"number of ranks (default: all GPUs, or 4 CPU ranks; at most {MAX_CPU_RANKS} on CPU, "
                        f"{MAX_RANKS_PER_GPU} per GPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="the ranks' torch.distributed group: nccl (GPUs) or gloo (CPU processes standing in for "
                        "GPUs, emulated); auto: nccl when there are GPUs")
    p.add_argument("--preset", default=None, choices=DECODER_PRESETS,
                   help="model size (default: k3-like on GPUs, tiny-deep on CPU)")
    p.add_argument("--steps", type=int_at_least(1), default=4,
                   help="checked steps with different token counts (default 4)")
    p.add_argument("--graph", action="store_true",
                   help="also time one-token decode replayed from a CUDA graph, beside eager (GPUs, --comm nccl)")
    p.add_argument("--timed-steps", type=int_at_least(1), default=None,
                   help="steps per timed variant (default 20 on GPUs, 5 on CPU ranks)")
    p.add_argument("--rounds", type=int_at_least(1), default=None,
                   help="rounds of the three timed variants, each round in a different order; the table shows "
                        "the median (default 7 on GPUs, where a round is short and rounds of one variant spread by "
                        "up to 25 %%, 3 on CPU ranks)")
    p.add_argument("--comm", default="auto", choices=COMM_CHOICES,
                   help="gather with torch.distributed or our NCCL binding (symmetric windows, copy engine); "
                        "auto: ours when the GPUs and libnccl support it")
    p.add_argument("--map-own-chunk", action=argparse.BooleanOptionalAction, default=None,
                   help="each layer gathers into a range mapped over its own chunk: no own-chunk copy, slots of "
                        "(N-1)/N (GPUs, our NCCL binding, NCCL >= 2.30). Default: where it can run and holds no more "
                        "(the package's map_own_chunk='auto'); --no-map-own-chunk: plain slots")
    p.add_argument("--issue-thread", action="store_true",
                   help="our NCCL communicator's native thread issues each layer's gather; the model's thread only "
                        "hands it over (GPUs, --comm nccl; off by default)")
    add_json_option(p, "the report", "--report")
    out = default_output("")
    p.add_argument("--figures", default=out, metavar="DIR",
                   help=f"folder for the figures ('' for none; 'figures' rewrites the committed ones; "
                        f"{default_help(out)})")
    p.add_argument("--figures-from", default=None, metavar="REPORT", type=nonempty_path,
                   help="only draw the figures of a saved report (e.g. one from a GPU machine without plotly)")
    p.add_argument("--prefix", default="", help="prefix of the figure file names")
