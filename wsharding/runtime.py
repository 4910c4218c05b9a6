"""Facts about where the package runs, used to scale notebooks and benchmarks down in CI."""

from __future__ import annotations

import os

import torch


def in_ci() -> bool:
    """True under CI (the ``CI`` environment variable is set): heavy cells scale down there."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
