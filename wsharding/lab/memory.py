"""Will it fit? The memory a run needs per rank, what the machine has, and a refusal in one message.

A demo on CPU ranks starts N processes that each build the replicated model *and* its sharded twin;
for ``k3-like`` that is about 11 GiB per rank, and 4 such ranks took a 24 GB machine down (the
kernel killed other processes). So ranks are started only after this check, and a notebook panel's
run button asks the same question of the cluster it already has.

Need per rank, counted from the model's own parameter shapes (built on the ``meta`` device, no memory):

* ``base``: torch, gloo and the package in a fresh process (CPU ranks; measured at about 230 MiB)
  or the CUDA context (GPU ranks);
* the replicated model ``R``, and the sharded twin ``R - S + S/N + 2 max|T_l|`` (``S``: bytes of the
  sharded targets, ``T_l``: one layer's flat buffer);
* while building, one layer's full weights before they shrink to rows, and the float32 temporary
  the deterministic init draws for the largest parameter.

Have: ``MemAvailable`` of ``/proc/meminfo`` (bounded by the cgroup's limit when there is one) on
CPU; the free memory of each GPU on GPUs, where ranks sharing a GPU add up.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.core.units import GiB, MiB, ceil_div
from wsharding.models import PRESETS, DecoderConfig, decoder_config
from wsharding.models.decoder import DecoderLayer

#: A CPU rank before it builds anything: torch, gloo's process group and the package.
CPU_RANK_BASE = 384 * MiB
#: A GPU rank's CUDA context and allocator slack.
GPU_RANK_BASE = 1 * GiB


class MemoryCheckError(WshardingError, RuntimeError):
    """The run would need more memory than the machine has; the message says what to pass instead."""


@dataclass(frozen=True)
class ModelBytes:
    """Bytes of a decoder's parameters, from their shapes."""

    replicated: int  #: every parameter (R)
    sharded_targets: int  #: the sharded layers' targets (S)
    max_layer_targets: int  #: one sharded layer's targets (max |T_l|, before padding)
    max_param_numel: int  #: elements of the largest parameter

    def sharded_resident(self, group: int) -> int:
        """Bytes the sharded twin keeps per rank: ``R - S + S/N + 2 max|T_l|``."""
        return self.replicated - self.sharded_targets + ceil_div(self.sharded_targets, group) + 2 * self.max_layer_targets


def model_bytes(cfg: DecoderConfig, sharded_layers: range | list[int] | None = None) -> ModelBytes:
    """Parameter bytes of the ``ToyDecoder`` of ``cfg`` (layers built on the meta device)."""
    sharded = set(range(1, cfg.layers) if sharded_layers is None else sharded_layers)
    with torch.device("meta"):
        dense, moe = DecoderLayer(cfg, 0), DecoderLayer(cfg, 1)
    nbytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in (dense, moe)]
    ends = 2 * cfg.vocab * cfg.hidden * cfg.torch_dtype.itemsize + cfg.hidden * cfg.torch_dtype.itemsize
    per_layer = cfg.sharded_bytes_per_layer()
    biggest = max(max(p.numel() for p in m.parameters()) for m in (dense, moe))
    return ModelBytes(
        replicated=nbytes[0] + nbytes[1] * (cfg.layers - 1) + ends,
        sharded_targets=per_layer * len(sharded),
        max_layer_targets=per_layer if sharded else 0,
        max_param_numel=max(biggest, cfg.vocab * cfg.hidden),
    )


def demo_need_per_rank(preset: str | DecoderConfig, group: int, *, on_gpu: bool = False) -> int:
    """Bytes one rank of ``wsharding demo`` needs: both models, the build peak and the base."""
    mb = model_bytes(decoder_config(preset))
    build_peak = mb.max_layer_targets + 4 * mb.max_param_numel
    return (GPU_RANK_BASE if on_gpu else CPU_RANK_BASE) + mb.replicated + mb.sharded_resident(group) + build_peak


def sharded_need_per_rank(preset: str | DecoderConfig, group: int, *, layers: int | None = None,
                          sharded_layers: list[int] | None = None) -> int:
    """Bytes a running rank needs to build one sharded decoder (a panel's run): no replicated twin,
    no base (the rank already runs)."""
    mb = model_bytes(decoder_config(preset, layers), sharded_layers)
    return mb.sharded_resident(group) + mb.max_layer_targets + 4 * mb.max_param_numel


def resident_share(preset: str | DecoderConfig, group: int, *, layers: int | None = None) -> float:
    """What a rank still holds of the sharded targets after finalize, as a share of R: its chunk of
    every sharded layer plus the two slots, ``(L * ceil(T/N) + 2 T) / (L T)`` -- about ``1/N + 2/L``
    for ``L`` equal sharded layers of ``T`` bytes (layer 0 stays replicated; padding left out).
    Sharding wins clearly only where both terms are small: a large group and many layers."""
    cfg = decoder_config(preset, layers)
    per_layer, sharded = cfg.sharded_bytes_per_layer(), cfg.layers - 1
    if sharded < 1 or group < 1:
        raise InvalidArgument(f"resident_share needs at least one sharded layer and a group >= 1 "
                             f"(layers {cfg.layers}, group {group})")
    return (sharded * ceil_div(per_layer, group) + 2 * per_layer) / (sharded * per_layer)


def _cgroup_free() -> int | None:
    """Bytes left under this process's cgroup (v2) memory limit, or None without a limit."""
    try:
        rel = Path("/proc/self/cgroup").read_text().split("::", 1)[1].strip()
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None


def cpu_available() -> tuple[int, str]:
    """``(bytes, where it was read)``: MemAvailable, bounded by a cgroup limit when there is one."""
    have, source = None, ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                have, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    if have is None:  # not Linux: total physical memory is the best we know
        have, source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
    cg = _cgroup_free()
    if cg is not None and cg < have:
        have, source = cg, "the cgroup's memory.max minus memory.current"
    return have, source


def gpu_available(index: int) -> int:
    """Free bytes of GPU ``index`` now."""
    return torch.cuda.mem_get_info(index)[0]


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def check_fits(need_per_rank: int, ranks: int, *, what: str, instead: str = "",
               device_indices: list[int | None] | None = None, have: int | None = None) -> None:
    """Raise :class:`MemoryCheckError` when ``ranks`` x ``need_per_rank`` does not fit.

    ``device_indices``: each rank's GPU (None entries or None: CPU ranks, checked against the host's
    available memory; GPU ranks are checked per GPU against its free memory). ``have`` overrides the
    available bytes (tests). ``instead``: what to pass instead, when known.
    """
    gpus = [d for d in (device_indices or []) if d is not None]
    if gpus:
        for index in sorted(set(gpus)):
            on_it = gpus.count(index)
            free = gpu_available(index) if have is None else have
            if on_it * need_per_rank > free:
                raise MemoryCheckError(
                    f"{what} needs about {on_it} x {_gib(need_per_rank)} = {_gib(on_it * need_per_rank)} on GPU "
                    f"{index}; it has {_gib(free)} free. {instead}".rstrip())
        return
    free, source = cpu_available() if have is None else (have, "given")
    total = ranks * need_per_rank
    if total > free:
        raise MemoryCheckError(
            f"{what} needs about {ranks} x {_gib(need_per_rank)} = {_gib(total)} of memory; this machine has "
            f"{_gib(free)} available ({source}). {instead}".rstrip())


def demo_alternatives(preset: str, ranks: int, fits: Callable[[str, int], bool]) -> str:
    """What to pass instead when ``preset`` on ``ranks`` ranks does not fit: fewer ranks, or the
    largest smaller preset. ``fits(preset, ranks)`` answers for one choice."""
    options = []
    fewer = next((n for n in range(ranks - 1, 0, -1) if fits(preset, n)), None)
    if fewer is not None:
        options.append(f"--ranks {fewer}")
    by_size = sorted((demo_need_per_rank(p, ranks), p) for p in PRESETS if p != preset)
    smaller = [p for _, p in by_size if fits(p, ranks)]
    if smaller:
        options.append(f"--preset {smaller[-1]}")
    if not options:
        return "No preset fits on this machine at all: free some memory first."
    return "Pass " + " or ".join(options) + " instead."


def check_demo_fits(preset: str, ranks: int, device_indices: list[int | None], *, have: int | None = None) -> None:
    """The demo's check before it starts ranks (see the module docstring). ``have``: available bytes
    (per GPU on GPUs) instead of reading them (tests)."""
    gpus = sorted({d for d in device_indices if d is not None})
    if gpus:
        free = min(gpu_available(d) for d in gpus) if have is None else have

        def fits(p: str, n: int) -> bool:
            return ceil_div(n, len(gpus)) * demo_need_per_rank(p, n, on_gpu=True) <= free
    else:
        free = cpu_available()[0] if have is None else have

        def fits(p: str, n: int) -> bool:
            return n * demo_need_per_rank(p, n) <= free

    need = demo_need_per_rank(preset, ranks, on_gpu=bool(gpus))
    check_fits(need, ranks, what=f"demo --preset {preset} on {ranks} ranks",
               instead=demo_alternatives(preset, ranks, fits), device_indices=device_indices, have=have)
