"""What our NCCL communicator refuses before it touches a GPU: arguments it does not know, and an
environment that would silently change what it asked NCCL for.

NCCL reads some settings from both the communicator's config and the environment, and the
environment wins without a word. A run that asked for the copy-engine AllGather but got SM kernels
would measure the wrong thing, so a mismatch is an error that says which variable to unset.
"""

from __future__ import annotations

import os

from wsharding.accel.nccl.binding import CTA_POLICY_NAMES
from wsharding.core.comm import CommError

#: "graph": each prepared gather's ncclAllGather is captured once and launched as a CUDA graph
#: (one driver call per layer); "direct": ncclAllGather is called per layer.
GATHER_LAUNCHES = ("graph", "direct")
#: The weight-sharding design refuses to run without it: policy 2 ("zero") is the copy-engine path.
CTA_POLICY_ZERO = 2


def check_gather_launch(how: str) -> None:
    """Refuse a ``gather_launch`` other than :data:`GATHER_LAUNCHES`."""
    if how not in GATHER_LAUNCHES:
        raise CommError(f"gather_launch must be one of {GATHER_LAUNCHES}, got {how!r}")


def check_cta_policy(policy: int) -> None:
    """Refuse a CTA policy NCCL does not define."""
    if policy not in CTA_POLICY_NAMES:
        raise CommError(f"cta_policy must be one of {sorted(CTA_POLICY_NAMES)}, got {policy!r}")


def parse_cta_policy(value: str) -> int:
    """``NCCL_CTA_POLICY`` as an int (numbers, or the names default/efficiency/zero)."""
    names = {v: k for k, v in CTA_POLICY_NAMES.items()}
    v = value.strip().lower()
    if v in names:
        return names[v]
    try:
        return int(v, 0)
    except ValueError:
        raise CommError(f"NCCL_CTA_POLICY={value!r} is not a CTA policy: use 0, 1, 2 or default/efficiency/zero") from None


def check_cta_policy_env(requested: int, environ: dict[str, str] | None = None) -> None:
    """The environment variable overrides the config field inside NCCL, silently. Refuse a
    mismatch, so a run that asked for the copy engine never measures SM kernels unawares."""
    env = os.environ if environ is None else environ
    raw = env.get("NCCL_CTA_POLICY")
    if raw is None or raw == "":
        return
    got = parse_cta_policy(raw)
    if got != requested:
        raise CommError(
            f"NCCL_CTA_POLICY={raw} ({CTA_POLICY_NAMES.get(got, '?')}) is set in the environment and overrides the "
            f"CTA policy {requested} ({CTA_POLICY_NAMES.get(requested, '?')}) this communicator asks for"
            + (" -- the copy-engine AllGather needs policy 2 (zero)" if requested == CTA_POLICY_ZERO else "")
            + f"; unset NCCL_CTA_POLICY or set it to {requested}"
        )


def check_shared_gpu_env(ranks_per_gpu: int, environ: dict[str, str] | None = None) -> None:
    """Several ranks on one GPU: NCCL refuses duplicate GPUs unless every rank opts in."""
    env = os.environ if environ is None else environ
    if env.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        raise CommError(
            f"{ranks_per_gpu} ranks share one GPU: set NCCL_MULTI_RANK_GPU_ENABLE=1 in every rank's "
            "environment (NCCL refuses duplicate GPUs otherwise)"
        )
