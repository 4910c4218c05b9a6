"""Finding libnccl and reading its version.

Which library a process uses decides what it can do: symmetric windows and the copy-engine
AllGather need NCCL >= 2.28.3, several ranks on one GPU need >= 2.30. So the choice is explicit,
reported (``wsharding info``), and gated with errors that say which file was loaded and how to get
a newer one.

Discovery order (first hit wins):

1. ``WSHARDING_NCCL_LIBRARY`` -- a path to ``libnccl.so.2``; a wrong path is an error, never a
   silent fallback, because the user asked for that file.
2. the ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheels of this Python environment;
3. the libnccl that torch already loaded into this process (read from ``/proc/self/maps``).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
from dataclasses import dataclass
from functools import cache

from wsharding.core.errors import WshardingError
from wsharding.io_checks import require_regular_file

ENV_VAR = "WSHARDING_NCCL_LIBRARY"
#: Symmetric windows with NCCL_WIN_COLL_SYMMETRIC and CTA policy "zero" (copy engine).
MIN_SYMMETRIC = (2, 28, 3)
#: Several ranks on one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1.
MIN_MULTI_RANK_GPU = (2, 30, 0)
#: A symmetric window over several allocations: layer views mapped over the resident chunks
#: (``map_own_chunk``; 2.29 refuses such a window, 2.28 shares only its first allocation).
MIN_MAPPED_VIEW = (2, 30, 0)
WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu13")


class NcclLibraryError(WshardingError, RuntimeError):
    """libnccl could not be found or loaded, or is too old for what was asked."""


class NcclLibraryMissing(NcclLibraryError):
    """No libnccl at all: not a broken install but one without the optional ``nccl`` extra (CPU ranks and
    torch.distributed gathers need none)."""


def decode_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as (major, minor, patch).

    From 2.9 on the code is X*10000 + Y*100 + Z (2.28.9 -> 22809); before, X*1000 + Y*100 + Z.
    """
    if code >= 20900:
        return code // 10000, (code // 100) % 100, code % 100
    return code // 1000, (code // 100) % 10, code % 100


def format_version(v: tuple[int, int, int]) -> str:
    return ".".join(str(x) for x in v)


def how_to_upgrade(minimum: tuple[int, int, int] = MIN_SYMMETRIC) -> str:
    """The fix for a library older than ``minimum``, naming that version (not the oldest one the
    package knows: a 2.28.9 told to install >= 2.28.3 for a 2.30 feature would change nothing)."""
    v = format_version(minimum)
    return (f"install a newer wheel (pip install 'nvidia-nccl-cu12>={v}' or 'nvidia-nccl-cu13>={v}') "
            f"or point {ENV_VAR} at a libnccl.so.2 of version {v} or later")


@dataclass(frozen=True)
class LibraryChoice:
    """Where a libnccl came from: ``path`` and ``source`` (``env``, a wheel name, ``torch``)."""

    path: str
    source: str


def wheels_for(cuda: str | None) -> tuple[str, ...]:
    """The NCCL wheels in the order to try them: the one built for torch's CUDA major version first
    (``cuda``: ``torch.version.cuda``; None on a CPU build), as a CUDA 13 torch wants the cu13 library."""
    major = (cuda or "").split(".")[0]
    return tuple(sorted(WHEELS, key=lambda w: not w.endswith(f"-cu{major}")))


def _wheel_libraries() -> list[LibraryChoice]:
    found = []
    try:
        import torch

        cuda = torch.version.cuda
    except ImportError:
        cuda = None
    for wheel in wheels_for(cuda):
        try:
            dist = importlib.metadata.distribution(wheel)
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in dist.files or ():
            if str(f).endswith("libnccl.so.2"):
                path = str(dist.locate_file(f))
                if os.path.exists(path):
                    found.append(LibraryChoice(path, f"{wheel} {dist.version} wheel"))
    return found


def _torch_loaded_library() -> LibraryChoice | None:
    """The libnccl mapped into this process by torch (CUDA builds link it dynamically)."""
    try:
        import torch  # noqa: F401 - importing torch is what maps its libnccl
    except ImportError:
        return None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "libnccl" in os.path.basename(path) and os.path.exists(path):
                    return LibraryChoice(path, "the library torch loaded")
    except OSError:
        return None
    return None


def find_library() -> LibraryChoice:
    """The libnccl to use, by the discovery order of this module's docstring."""
    env = os.environ.get(ENV_VAR)
    if env:
        if not os.path.isfile(env):
            raise NcclLibraryError(
                f"{ENV_VAR}={env!r} does not name a file: point it at a libnccl.so.2 "
                f"(e.g. .../site-packages/nvidia/nccl/lib/libnccl.so.2) or unset it to use the wheel"
            )
        return LibraryChoice(env, f"{ENV_VAR}")
    wheels = _wheel_libraries()
    if wheels:
        return wheels[0]
    loaded = _torch_loaded_library()
    if loaded:
        return loaded
    raise NcclLibraryMissing(
        f"no libnccl found: set {ENV_VAR} to a libnccl.so.2, or install a wheel "
        "(pip install 'wsharding[nccl]', or nvidia-nccl-cu12 or nvidia-nccl-cu13)"
    )


@dataclass(frozen=True)
class NcclLibrary:
    """A loaded libnccl: the ctypes handle, its path, where it came from and its version code."""

    path: str
    source: str
    version_code: int
    handle: ctypes.CDLL

    @property
    def version(self) -> tuple[int, int, int]:
        return decode_version(self.version_code)

    @property
    def version_str(self) -> str:
        return format_version(self.version)

    def supports(self, minimum: tuple[int, int, int]) -> bool:
        return self.version >= minimum

    def require(self, minimum: tuple[int, int, int], feature: str) -> None:
        """Raise :class:`NcclLibraryError` naming version, path and the fix when too old."""
        if not self.supports(minimum):
            raise NcclLibraryError(
                f"{feature} needs NCCL >= {format_version(minimum)}, but the library loaded is NCCL "
                f"{self.version_str} from {self.path} ({self.source}); {how_to_upgrade(minimum)}"
            )

    def describe(self) -> dict[str, object]:
        return {
            "path": self.path,
            "source": self.source,
            "version": self.version_str,
            "version_code": self.version_code,
            "symmetric_windows": self.supports(MIN_SYMMETRIC),
            "copy_engine_allgather": self.supports(MIN_SYMMETRIC),
            "multi_rank_per_gpu": self.supports(MIN_MULTI_RANK_GPU),
            "mapped_layer_views": self.supports(MIN_MAPPED_VIEW),
        }


def load_library(path: str | None = None, source: str | None = None) -> NcclLibrary:
    """Load ``path`` (default: :func:`find_library`) and read its version with ncclGetVersion."""
    if path is None:
        choice = find_library()
        path, source = choice.path, choice.source
    if not os.path.exists(path):
        raise NcclLibraryError(f"NCCL library {path!r} does not exist; {how_to_upgrade()}")
    # dlopen opens the path: a FIFO there (WSHARDING_NCCL_LIBRARY=/some/fifo) would wait for a writer
    # ([Note: only regular files] in wsharding.io_checks); a folder or a device is said as such.
    require_regular_file(path, "NCCL library", max_bytes=None, todo=how_to_upgrade(), error=NcclLibraryError)
    try:
        handle = ctypes.CDLL(path)
    except OSError as e:
        raise NcclLibraryError(f"could not load NCCL library {path!r}: {e}") from e
    if not hasattr(handle, "ncclGetVersion"):
        raise NcclLibraryError(f"{path!r} has no ncclGetVersion: it is not libnccl")
    code = ctypes.c_int(0)
    rc = handle.ncclGetVersion(ctypes.byref(code))
    if rc != 0:
        raise NcclLibraryError(f"ncclGetVersion failed with result {rc} in {path!r}")
    return NcclLibrary(path=path, source=source or "explicit path", version_code=code.value, handle=handle)


@cache
def _cached(path: str, source: str) -> NcclLibrary:
    return load_library(path, source)


def default_library() -> NcclLibrary:
    """The process-wide library by the discovery order (loaded once per path)."""
    choice = find_library()
    return _cached(choice.path, choice.source)
