"""The options of ``wsharding bench draft`` (:mod:`wsharding.lab.bench.draft` runs it)."""

from __future__ import annotations

import argparse

from wsharding.lab.args.names import COMM_CHOICES, DECODER_PRESETS
from wsharding.lab.cliargs import checked_number, int_at_least
from wsharding.lab.outdir import default_help, default_output

#: The longest region between the models, in ms: it stands in for a commit step of a few ms, and every
#: timed step of every mode waits it out (1e9 ms would be about 11 days per step).
MAX_COMMIT_MS = 1000.0

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None, help="ranks (default: all GPUs, or 2 CPU ranks)")
    p.add_argument("--preset", default=None, choices=DECODER_PRESETS,
                   help="target model (the draft has its dimensions, 2 layers); default k3-like on GPUs, tiny on CPU")
    p.add_argument("--tokens", type=int_at_least(1), default=8, help="tokens per rank per step (default 8)")
    p.add_argument("--steps", type=int_at_least(1), default=20, help="timed steps per mode (default 20)")
    p.add_argument("--commit-ms", type=checked_number(float, 0, MAX_COMMIT_MS),
                   default=4.0, help="length of the region between the models in ms (default 4, the "
                                     f"weight-sharding design's commit step; at most {MAX_COMMIT_MS:g})")
    p.add_argument("--comm", default="auto", choices=COMM_CHOICES,
                   help="gather with torch.distributed or our NCCL binding (auto: ours where it runs)")
    out = default_output("bench_draft")
    p.add_argument("--json", default=out, metavar="PREFIX",
                   help=f"path prefix for .json and the figure ('' for none; {default_help(out)})")
    p.add_argument("--out", dest="json", help=argparse.SUPPRESS)  # the old name
