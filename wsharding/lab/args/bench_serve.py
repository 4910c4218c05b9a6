"""The options of ``wsharding bench serve`` (:mod:`wsharding.lab.bench.serve` runs it)."""

from __future__ import annotations

import argparse
import math

from wsharding.lab.args.names import COMM_CHOICES, DECODER_PRESETS
from wsharding.lab.cliargs import checked_number, int_at_least, length_range, number_list, slo_arg
from wsharding.lab.outdir import default_help, default_output


def rate_list(text: str) -> list[float]:
    """The argparse ``type`` of ``--rate``: a comma list of numbers, ``inf`` included (all at once).
    Whether each is > 0 is Workload's rule, answered in one line by
    :func:`~wsharding.lab.cliargs.run_command`."""
    out = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            rate = math.nan
        if math.isnan(rate):
            raise argparse.ArgumentTypeError(f"{part!r} is not a number of requests per second (inf: all at once)")
        out.append(rate)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None,
                   help="ranks (default: every GPU -- two on a single GPU where NCCL >= 2.30 -- or 2 CPU ranks)")
    p.add_argument("--engine", default="wsharding", choices=["wsharding", "transformers"],
                   help="the serving engine: the package's own scheduler (default) or transformers' continuous "
                        "batching over a Llama built from a config (the 'hf' extra; wsharding/lab/bench/serve_engine.py)")
    p.add_argument("--hf-model", default=None, choices=["tiny", "llama-1b", "llama-3b"],
                   help="--engine transformers: the Llama's shapes (default llama-1b on GPUs, tiny on CPU)")
    p.add_argument("--preset", default=None, choices=DECODER_PRESETS, help="model (default k3-like on GPUs, tiny-deep on CPU)")
    p.add_argument("--layers", type=int_at_least(2), default=None, help="layers (default: the preset's)")
    p.add_argument("--kv-share", type=number_list(float, 0.0, "fraction", "0.05,0.2,0.6", below=1.0), default=None,
                   help="budgets in which the replicated KV pool is this share of the budget; a comma list sweeps "
                        "the crossover (default on GPUs 0.05,0.5: one where the replicated pool limits, one where it "
                        "does not; on CPU ranks budgets of 0.25 and 1.5 times the workload's KV demand)")
    p.add_argument("--utilization", type=checked_number(float, 0.0, 1.0), default=None,
                   help="a budget as a server sizes it: this fraction of the device memory, split between the ranks "
                        "on it (as gpu_memory_utilization)")
    p.add_argument("--memory-gib", type=checked_number(float, 0.0), default=None,
                   help="the device memory for --utilization (default: the GPU's; CPU ranks need it)")
    p.add_argument("--budget-gib", type=number_list(float, 0.0, "GiB", "4,8,16"), default=None,
                   help="memory budget per rank, GiB; a comma list sweeps")
    p.add_argument("--budget-mib", type=number_list(float, 0.0, "MiB", "3,4,6"), default=None,
                   help="the same in MiB (for the small CPU models)")
    p.add_argument("--requests", type=int_at_least(1), default=None,
                   help="requests per rank per trial (default 60 on GPUs, 12 on CPU)")
    p.add_argument("--rate", type=rate_list, default=None,
                   help="request rates per rank, requests/s, > 0, a comma list sweeps; inf: all at once "
                        "(default 2,4,8 on GPUs, 8,32 on CPU)")
    p.add_argument("--burstiness", type=checked_number(float, 0.0), default=1.0,
                   help="gamma shape of the gaps between arrivals: 1 Poisson (default), < 1 burstier")
    p.add_argument("--max-concurrency", type=int_at_least(1), default=None,
                   help="at most this many requests in flight per rank (clients wait for a slot)")
    p.add_argument("--trials", type=int_at_least(1), default=2,
                   help="runs per point, other seeds; the variant that goes first alternates (default 2)")
    p.add_argument("--warmup", type=int_at_least(0), default=None,
                   help="requests per rank left out of the metrics (default a tenth)")
    p.add_argument("--slo", type=slo_arg, default=None,
                   help="SLOs for goodput, ms: ttft=MS,tpot=MS[,e2e=MS][,attainment=0.9] "
                        "(default ttft=2000,tpot=200 on GPUs, ttft=1000,tpot=100 on CPU)")
    p.add_argument("--dataset", default="random", choices=["random", "sharegpt"],
                   help="request lengths: uniform ranges (default) or ShareGPT V3's (the 'trace' extra)")
    p.add_argument("--prompt", type=length_range, default=None, help="prompt lengths LOW:HIGH, uniform (default 8:24 CPU, 64:512 GPU)")
    p.add_argument("--output", type=length_range, default=None, help="output lengths LOW:HIGH, uniform (default 4:16 CPU, 128:512 GPU)")
    p.add_argument("--token-budget", type=int_at_least(1), default=None,
                   help="tokens per step, prefill chunks included (default 32 CPU, 256 GPU)")
    p.add_argument("--max-seqs", type=int_at_least(1), default=None, help="running requests per step at most (default: the token budget)")
    p.add_argument("--reserve-mib", type=checked_number(float, 0.0), default=None,
                   help="activation reserve per rank, MiB (default: the stated rule, activation_reserve_bytes)")
    p.add_argument("--comm", default="auto", choices=COMM_CHOICES,
                   help="gather with torch.distributed or our NCCL binding (auto: ours where it runs)")
    p.add_argument("--plain", action="store_true", help="also serve the sharded model with plain slots where it maps its own chunk")
    p.add_argument("--graphs", default="auto", choices=["auto", "on", "off"],
                   help="replay each captured decode step shape from a CUDA graph, as servers do (auto: where CUDA "
                        "and the communicator can capture; both variants or neither, the report says why)")
    p.add_argument("--no-check", action="store_true", help="skip the replay that checks the tokens (not for a saved result)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--from-json", default=None, metavar="SAVED", nargs="+",
                   help="serve nothing: check a saved report (its .json) against the report's schema, print it with "
                        "its answers computed again, and write it again with its figures under --json; several "
                        "reports of one set-up at other budgets (one call per --kv-share) are merged into one, "
                        "with the crossover of all their budgets")
    p.add_argument("--predict", action="store_true",
                   help="after the report, the run PREDICTED from its own measured steps (the package's scheduler "
                        "replayed on a virtual clock, judged as a pair) beside its measured sustained rates, with the "
                        "error of each (a replay: seconds on CPU)")
    out = default_output("bench_serve")
    p.add_argument("--json", default=out, metavar="PREFIX",
                   help=f"path prefix for .json and the figure ('' for none; {default_help(out)})")
