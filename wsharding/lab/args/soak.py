"""The options of ``wsharding soak`` (:mod:`wsharding.lab.soak` runs it)."""

from __future__ import annotations

import argparse

from wsharding.lab.args.names import COMM_CHOICES, DECODER_PRESETS
from wsharding.lab.cliargs import add_json_option, int_at_least

#: Steps before the first count is taken (the flight recorder fills, the allocator settles); growth is
#: measured from there to the last step.
WARMUP = 50
#: The fewest soak steps: the warm-up, then at least one step whose counts are compared with it.
MIN_STEPS = WARMUP + 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=3, help="rank processes (default 3)")
    p.add_argument("--steps", type=int_at_least(MIN_STEPS, why=f"{WARMUP} warm-up steps, then the checked ones"),
                   default=1000, help=f"soak steps (default 1000, at least {MIN_STEPS}: the first {WARMUP} warm up)")
    p.add_argument("--preset", default="tiny", choices=DECODER_PRESETS, help="decoder preset (default tiny)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="gloo: CPU ranks (default); nccl: GPUs")
    p.add_argument("--comm", default="torch", choices=COMM_CHOICES[1:],
                   help="gather with torch.distributed (default) or our NCCL communicator (GPUs)")
    p.add_argument("--no-faults", action="store_true", help="skip the three fault runs")
    add_json_option(p, "the report", "--report")
