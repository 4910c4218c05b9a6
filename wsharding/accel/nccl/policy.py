"""What our NCCL communicator refuses before it touches a GPU: arguments it does not know, and an
environment that would silently change what it asked NCCL for.

NCCL reads some settings from both the communicator's config and the environment, and the
environment wins without a word. A run that asked for the copy-engine AllGather but got SM kernels
would measure the wrong thing, so a mismatch is an error that says which variable to unset.
"""

from __future__ import annotations

import os

import torch

from wsharding.accel.nccl.binding import CTA_POLICY_NAMES
from wsharding.core.comm import CommError
from wsharding.core.errors import require_int

#: "graph": each prepared gather's ncclAllGather is captured once and launched as a CUDA graph
#: (one driver call per layer); "direct": ncclAllGather is called per layer.
GATHER_LAUNCHES = ("graph", "direct")
#: The weight-sharding design refuses to run without it: policy 2 ("zero") is the copy-engine path.
CTA_POLICY_ZERO = 2


def check_gather_launch(how: str) -> None:
    """Refuse a ``gather_launch`` other than :data:`GATHER_LAUNCHES`."""
    if how not in GATHER_LAUNCHES:
        raise CommError(f"gather_launch must be one of {GATHER_LAUNCHES}, got {how!r}")


def check_cta_policy(policy: int) -> int:
    """``policy`` when NCCL defines it; else refused. A bool or a float would pass the lookup below
    (``True == 1``, ``2.0 == 2``) and reach NCCL's config as something else than an int: whole numbers
    only ([Note: whole numbers only] in ``wsharding/core/errors.py``)."""
    policy = require_int(policy, "cta_policy", minimum=None, where="NcclCommunicator", error=CommError,
                         todo=f"pass one of {sorted(CTA_POLICY_NAMES)} ({CTA_POLICY_ZERO}: the copy engine)")
    if policy not in CTA_POLICY_NAMES:
        raise CommError(f"cta_policy must be one of {sorted(CTA_POLICY_NAMES)}, got {policy!r}")
    return policy


def check_device_arg(device: object) -> None:
    """Refuse, before any GPU is touched, a device index that is not a whole number >= 0 (``True``
    would be ``cuda:1``, ``1.0`` a TypeError deep in torch) or a name torch does not know (``"2"``);
    ``torch.device`` passes on."""
    if device is None or isinstance(device, torch.device):
        return
    if isinstance(device, str):
        try:
            torch.device(device)
        except RuntimeError:  # torch's words name no argument: "Invalid device string: '2'"
            hint = f"'cuda:{device.strip()}' or {device.strip()}" if device.strip().isdigit() else "'cuda:N' or N"
            raise CommError(f"NcclCommunicator: device {device!r} is not a device name; pass {hint}") from None
        return
    require_int(device, "device", where="NcclCommunicator", error=CommError,
                todo="pass a CUDA device index >= 0, 'cuda:N' or a torch.device")


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
