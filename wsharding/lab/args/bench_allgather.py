"""The options of ``wsharding bench allgather`` (:mod:`wsharding.lab.bench.allgather` runs it)."""

from __future__ import annotations

import argparse

from wsharding.core.units import MiB
from wsharding.lab.cliargs import add_json_option, int_at_least, number_list

DEFAULT_SIZES_MIB = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
CPU_SIZES_MIB = [0.25, 1, 4]
#: Gathers per timed repetition on CPU processes (gloo over loopback is slow; the spread shows noise).
CPU_ITERS = 5
#: The smallest size measured: one layout's alignment unit (a layer's flat buffer is never smaller);
#: below it a size rounds to nothing per rank and its row reads 0.00 MiB.
MIN_SIZE_BYTES = 16  # ALIGNMENT of wsharding.core.layout, which imports torch (a test checks they agree)


def _size_list(text: str) -> list[float]:
    sizes = number_list(float, 0, "MiB", "1,16,64")(text)
    small = [s for s in sizes if s * MiB < MIN_SIZE_BYTES]
    if small:
        raise argparse.ArgumentTypeError(f"{small[0]:g} MiB is {small[0] * MiB:.3g} bytes: every size must be at least "
                                         f"{MIN_SIZE_BYTES} bytes ({MIN_SIZE_BYTES / MiB:.3g} MiB), the smallest flat "
                                         "layer buffer")
    return sizes


SIZES = _size_list


def _policy_list(text: str) -> list[int]:
    policies = number_list(int, 0, "CTA policy", "2,0")(text)
    bad = [p for p in policies if p not in (0, 2)]
    if bad:
        raise argparse.ArgumentTypeError(f"CTA policy {bad[0]} is not measured here: use 2 (copy engine) and/or 0 (SM)")
    return policies


POLICIES = _policy_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int_at_least(1), default=None,
                   help="ranks (default: the number of GPUs; 2 on CPU)")
    p.add_argument("--ranks-per-gpu", type=int_at_least(1), default=None,
                   help="ranks sharing one GPU (NCCL >= 2.30; default: as many as needed to fit the GPUs)")
    p.add_argument("--sizes", type=SIZES, default=None, metavar="MiB,...",
                   help="per-layer sizes in MiB, comma separated (default "
                        f"{','.join(f'{s:g}' for s in DEFAULT_SIZES_MIB)} on GPU, "
                        f"{','.join(f'{s:g}' for s in CPU_SIZES_MIB)} on CPU)")
    p.add_argument("--policies", type=POLICIES, default=[2, 0], metavar="P,...",
                   help="CTA policies of our communicator to measure: 2 (copy engine), 0 (SM kernels) (default 2,0)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed NCCL baseline")
    p.add_argument("--overlap", type=SIZES, default=[], metavar="MiB,...",
                   help="sizes in MiB to also time beside an 8192^3 bf16 GEMM (GPU only; default none)")
    p.add_argument("--iters", type=int_at_least(1), default=None,
                   help=f"back-to-back gathers per timed repetition (default 20 on GPU, {CPU_ITERS} on CPU)")
    p.add_argument("--reps", type=int_at_least(1), default=None,
                   help="timed repetitions; the median is reported, on CPU with its min-max (default 5 on GPU, 3 on CPU)")
    p.add_argument("--cpu", action="store_true", help="run the gloo variant on CPU processes even with a GPU")
    add_json_option(p, "the result")
