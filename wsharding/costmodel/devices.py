"""Device presets: the peak numbers of one GPU that turn FLOPs and bytes into seconds.

Kept apart from the bill because they are datasheet figures, not arithmetic: the memory bill needs
none of them, the timing model needs only these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from wsharding.core.units import GB
from wsharding.costmodel.checks import CostModelError


@dataclass(frozen=True)
class Device:
    """Peak numbers of one GPU, used only to turn FLOPs and bytes into seconds.

    ``peak_flops`` maps a precision class (``"fp8"`` for 1-byte weights, ``"bf16"`` for 2-byte,
    ``"tf32"`` for 4-byte) to dense tensor-core FLOP/s. ``link_bandwidth`` is the per-direction
    NVLink bandwidth of one GPU in bytes/s: the most a rank can receive during an AllGather.
    """

    name: str
    peak_flops: Mapping[str, float]
    link_bandwidth: float
    hbm_bytes: int
    source: str

    def peak_for(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s for GEMMs on weights of ``dtype`` (chosen by its size in bytes)."""
        key = {1: "fp8", 2: "bf16", 4: "tf32"}[dtype.itemsize]
        return self.peak_flops[key]


#: The page of ``map_own_chunk``'s mapped views: CUDA's allocation granularity, 2 MiB on an H200
#: (``cuMemGetAllocationGranularity``, measured; the sharding asks the driver, the cost model assumes it).
MAPPED_PAGE_BYTES = 2 * 2**20

#: Public datasheet figures (dense, i.e. the "with sparsity" numbers halved). Nominal peaks: real
#: GEMMs reach a fraction of them, which is what ``Deployment.efficiency`` is for.
DEVICES: dict[str, Device] = {
    "b200": Device(
        "b200",
        {"fp8": 4.5e15, "bf16": 2.25e15, "tf32": 1.1e15},
        link_bandwidth=900e9,
        hbm_bytes=180 * GB,
        source="NVIDIA HGX/DGX B200 datasheet per GPU: FP8 9 PF and BF16 4.5 PF with sparsity (dense: half), "
        "NVLink 5 1.8 TB/s bidirectional (900 GB/s per direction), 180 GB HBM3e",
    ),
    "h200": Device(
        "h200",
        {"fp8": 1.979e15, "bf16": 0.989e15, "tf32": 0.494e15},
        link_bandwidth=450e9,
        hbm_bytes=141 * GB,
        source="NVIDIA H200 SXM datasheet: FP8 3,958 TF and BF16 1,979 TF with sparsity (dense: half), "
        "NVLink 4 900 GB/s bidirectional (450 GB/s per direction), 141 GB HBM3e",
    ),
}


def get_device(name: str | Device) -> Device:
    """The :class:`Device` preset called ``name`` (``b200``, ``h200``) or ``name`` itself."""
    if isinstance(name, Device):
        return name
    key = str(name).lower()
    if key not in DEVICES:
        raise CostModelError(f"device: unknown device {name!r}; known: {sorted(DEVICES)}")
    return DEVICES[key]
