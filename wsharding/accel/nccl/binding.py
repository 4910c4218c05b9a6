"""The ctypes binding of libnccl: types and a declarative table of the functions we call.

Each row of :data:`FUNCTIONS` is (name, return type, argument types, first version that has it).
:class:`NcclBinding` sets ``restype``/``argtypes`` from the table, so every call is type checked by
ctypes, and :meth:`NcclBinding.check` turns a failing result into an :class:`NcclError` carrying
``ncclGetErrorString`` and, when a communicator is known, ``ncclGetLastError``.

The layout of :class:`NcclConfig` follows ``ncclConfig_t`` of nccl.h as of 2.28 (80 bytes on
x86-64). Newer libraries only append fields, and read ``size``/``version`` to know how much of
the struct we filled, so this layout works on 2.28 and later.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_void_p
from dataclasses import dataclass

from wsharding.accel.nccl.library import NcclLibrary
from wsharding.core.comm import CommError

# ---- scalar types ---------------------------------------------------------------------------------
ncclResult_t = c_int
ncclDataType_t = c_int
ncclComm_t = c_void_p
ncclWindow_t = c_void_p
cudaStream_t = c_void_p

# ---- constants from nccl.h ----------------------------------------------------------------------
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7
RESULT_NAMES = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError", 3: "ncclInternalError",
    4: "ncclInvalidArgument", 5: "ncclInvalidUsage", 6: "ncclRemoteError", 7: "ncclInProgress",
}
NCCL_UINT8 = 1
NCCL_WIN_COLL_SYMMETRIC = 0x01
NCCL_CONFIG_MAGIC = 0xCAFEBEEF
#: The ncclConfig_t version we fill in: NCCL_VERSION(2, 28, 0).
NCCL_CONFIG_VERSION = 22800
NCCL_CONFIG_UNDEF_INT = -(2**31)  # INT_MIN
CTA_POLICY_NAMES = {0: "default", 1: "efficiency", 2: "zero"}
NCCL_UNIQUE_ID_BYTES = 128


class NcclUniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, passed by value to ncclCommInitRankConfig."""

    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), NCCL_UNIQUE_ID_BYTES)

    @classmethod
    def from_bytes(cls, raw: bytes) -> NcclUniqueId:
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            raise CommError(f"an ncclUniqueId has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        uid = cls()
        ctypes.memmove(ctypes.addressof(uid), raw, NCCL_UNIQUE_ID_BYTES)
        return uid


class NcclConfig(ctypes.Structure):
    """``ncclConfig_t`` (nccl.h, 2.28). Build it with :func:`make_config`; unset fields stay
    INT_MIN / NULL, which NCCL reads as "use the default"."""

    _fields_ = [
        ("size", c_size_t),
        ("magic", c_uint),
        ("version", c_uint),
        ("blocking", c_int),
        ("cgaClusterSize", c_int),
        ("minCTAs", c_int),
        ("maxCTAs", c_int),
        ("netName", c_char_p),
        ("splitShare", c_int),
        ("trafficClass", c_int),
        ("commName", c_char_p),
        ("collnetEnable", c_int),
        ("CTAPolicy", c_int),
        ("shrinkShare", c_int),
        ("nvlsCTAs", c_int),
        ("nChannelsPerNetPeer", c_int),
        ("nvlinkCentricSched", c_int),
    ]


#: The layout ``nccl.h`` documents for ``ncclConfig_t``: field -> byte offset; tests compare against it.
CONFIG_LAYOUT = {
    "size": 0, "magic": 8, "version": 12, "blocking": 16, "cgaClusterSize": 20, "minCTAs": 24,
    "maxCTAs": 28, "netName": 32, "splitShare": 40, "trafficClass": 44, "commName": 48,
    "collnetEnable": 56, "CTAPolicy": 60, "shrinkShare": 64, "nvlsCTAs": 68,
    "nChannelsPerNetPeer": 72, "nvlinkCentricSched": 76,
}
CONFIG_SIZE = 80


def make_config(*, blocking: bool, cta_policy: int | None, comm_name: bytes | None = None) -> NcclConfig:
    """The equivalent of ``NCCL_CONFIG_INITIALIZER`` plus the fields we set."""
    cfg = NcclConfig()
    cfg.size = ctypes.sizeof(NcclConfig)
    cfg.magic = NCCL_CONFIG_MAGIC
    cfg.version = NCCL_CONFIG_VERSION
    for name, ctype in NcclConfig._fields_:
        if ctype is c_int:
            setattr(cfg, name, NCCL_CONFIG_UNDEF_INT)
    cfg.blocking = 1 if blocking else 0
    if cta_policy is not None:
        cfg.CTAPolicy = cta_policy
    cfg.commName = comm_name
    return cfg


@dataclass(frozen=True)
class Fn:
    """One row of the binding table."""

    name: str
    restype: object
    argtypes: tuple
    since: str = "2.0"
    doc: str = ""


#: Every libnccl function the backend calls.
FUNCTIONS: tuple[Fn, ...] = (
    Fn("ncclGetVersion", ncclResult_t, (POINTER(c_int),), doc="version code X*10000+Y*100+Z"),
    Fn("ncclGetUniqueId", ncclResult_t, (POINTER(NcclUniqueId),), doc="rank 0 makes the id, the CPU group shares it"),
    Fn("ncclGetErrorString", c_char_p, (ncclResult_t,), doc="text of a result code"),
    Fn("ncclGetLastError", c_char_p, (ncclComm_t,), doc="last error message of a communicator"),
    Fn("ncclCommInitRankConfig", ncclResult_t, (POINTER(ncclComm_t), c_int, NcclUniqueId, c_int, POINTER(NcclConfig)),
       since="2.14", doc="collective: create a communicator with our config"),
    Fn("ncclCommGetAsyncError", ncclResult_t, (ncclComm_t, POINTER(ncclResult_t)), doc="poll a non-blocking comm"),
    Fn("ncclCommFinalize", ncclResult_t, (ncclComm_t,), since="2.14", doc="collective: flush before destroy"),
    Fn("ncclCommDestroy", ncclResult_t, (ncclComm_t,), doc="free a finalized communicator"),
    Fn("ncclCommAbort", ncclResult_t, (ncclComm_t,), doc="tear down; does not release a copy-engine gather stuck on the GPU (2.28)"),
    Fn("ncclMemAlloc", ncclResult_t, (POINTER(c_void_p), c_size_t), since="2.19", doc="cuMem-backed device memory"),
    Fn("ncclMemFree", ncclResult_t, (c_void_p,), since="2.19", doc="free ncclMemAlloc memory"),
    Fn("ncclCommWindowRegister", ncclResult_t, (ncclComm_t, c_void_p, c_size_t, POINTER(ncclWindow_t), c_int),
       since="2.27", doc="collective: register a symmetric window"),
    Fn("ncclCommWindowDeregister", ncclResult_t, (ncclComm_t, ncclWindow_t), since="2.27",
       doc="collective: deregister a window"),
    Fn("ncclAllGather", ncclResult_t, (c_void_p, c_void_p, c_size_t, ncclDataType_t, ncclComm_t, cudaStream_t),
       doc="collective: gather sendcount elements from every rank"),
)


class NcclError(CommError):
    """A libnccl call returned an error. ``result`` is the ncclResult_t code."""

    def __init__(self, what: str, result: int, text: str, last: str = "") -> None:
        self.result = result
        msg = f"{what} failed: {RESULT_NAMES.get(result, 'result')} ({result}): {text}"
        if last:
            msg += f" -- NCCL says: {last}"
        super().__init__(msg)


class NcclBinding:
    """Typed access to a loaded libnccl. ``binding.ncclAllGather(...)`` calls the C function;
    ``binding.check(rc, what, comm)`` raises :class:`NcclError` for anything but success."""

    def __init__(self, library: NcclLibrary) -> None:
        self.library = library
        self.missing: list[str] = []
        for fn in FUNCTIONS:
            try:
                cfn = getattr(library.handle, fn.name)
            except AttributeError:
                self.missing.append(fn.name)  # too old a library: the version gate explains
                continue
            cfn.restype = fn.restype
            cfn.argtypes = list(fn.argtypes)
            setattr(self, fn.name, cfn)

    def error_string(self, result: int) -> str:
        raw = self.ncclGetErrorString(result)
        return raw.decode(errors="replace") if raw else ""

    def last_error(self, comm: int | None) -> str:
        if comm is None or not hasattr(self, "ncclGetLastError"):
            return ""
        raw = self.ncclGetLastError(comm)
        return raw.decode(errors="replace").strip() if raw else ""

    def check(self, result: int, what: str, comm: int | None = None, *, allow_in_progress: bool = False) -> int:
        """Return ``result`` if it is success (or in-progress when allowed), else raise."""
        if result == NCCL_SUCCESS or (allow_in_progress and result == NCCL_IN_PROGRESS):
            return result
        raise NcclError(what, result, self.error_string(result), self.last_error(comm))

    def get_unique_id(self) -> NcclUniqueId:
        uid = NcclUniqueId()
        self.check(self.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid


def binding_table() -> list[dict[str, str]]:
    """The table as rows (for the notebook and ``wsharding info``)."""

    def tname(t: object) -> str:
        names = {c_int: "int", c_uint: "unsigned", c_char_p: "const char*", c_void_p: "void*", c_size_t: "size_t"}
        if t in names:
            return names[t]
        target = getattr(t, "_type_", None)
        if isinstance(target, type) and t.__name__.startswith("LP_"):
            return tname(target) + "*"
        return getattr(t, "__name__", str(t))

    return [
        {"function": f.name, "returns": "ncclResult_t" if f.restype is ncclResult_t else tname(f.restype), "arguments": ", ".join(tname(a) for a in f.argtypes),
         "since": f.since, "why": f.doc}
        for f in FUNCTIONS
    ]
