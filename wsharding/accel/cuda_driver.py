"""The CUDA driver calls of the per-layer hot path, bound with ctypes: three for events, stream waits
and the own-chunk copy, and the graph calls that capture a gather once and launch it per layer
([Note: a gather launched as a graph] in ``wsharding/accel/captured_launch.py``).

Why not torch's own wrappers: the gather of one layer needs an event record, two stream waits and a
device-to-device copy on streams other than the current one. Measured on an H200 (torch 2.11, host
microseconds per call): ``torch.cuda.current_stream()`` 6.6, ``Event.record()`` on the current stream
9.1, ``with torch.cuda.stream(s)`` 9.7, ``tensor.copy_`` 7.0 -- against 0.7 for ``cuEventRecord``,
0.9 for ``cuStreamWaitEvent`` through ctypes. A layer issues about eight such calls, and at decode
sizes the host is the bottleneck, so these microseconds are the step time.

torch's handles are the driver's: ``torch.cuda.Event.cuda_event`` is a ``CUevent`` and
``torch.cuda.Stream.cuda_stream`` a ``CUstream`` (the runtime and driver types are the same objects).

The library is ``libcuda.so.1``, which the NVIDIA driver installs and every CUDA process has already
loaded; it is opened on first use, so importing this module on a machine without a GPU costs nothing.
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import c_int, c_size_t, c_uint, c_void_p
from dataclasses import dataclass
from types import SimpleNamespace

from wsharding.core.errors import WshardingError

CUresult = c_int
CUstream = c_void_p
CUevent = c_void_p
CUdeviceptr = ctypes.c_uint64


@dataclass(frozen=True)
class DriverFn:
    """One row of the binding table: the C name, its result and argument types, and why we need it."""

    name: str
    argtypes: tuple
    doc: str


#: Every driver function the hot path calls.
FUNCTIONS: tuple[DriverFn, ...] = (
    # CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
    DriverFn("cuEventRecord", (CUevent, CUstream), "record an event on a stream that is not the current one"),
    # CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
    DriverFn("cuStreamWaitEvent", (CUstream, CUevent, c_uint), "make a stream wait for an event (no host wait)"),
    # CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream hStream)
    DriverFn("cuMemcpyDtoDAsync_v2", (CUdeviceptr, CUdeviceptr, c_size_t, CUstream),
             "copy a rank's own chunk into its place in the slot, on the copy stream"),
)

CUgraph = c_void_p
CUgraphExec = c_void_p

#: The driver functions that capture, instantiate, launch and destroy a graph (``captured_launch``).
GRAPH_FUNCTIONS: tuple[DriverFn, ...] = (
    # CUresult cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode)
    DriverFn("cuStreamBeginCapture_v2", (CUstream, c_int), "start recording a stream's work into a graph"),
    # CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph)
    DriverFn("cuStreamEndCapture", (CUstream, ctypes.POINTER(CUgraph)), "end the recording, get the graph"),
    # CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags)
    DriverFn("cuGraphInstantiateWithFlags", (ctypes.POINTER(CUgraphExec), CUgraph, ctypes.c_uint64),
             "make the launchable form of a graph"),
    # CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)
    DriverFn("cuGraphUpload", (CUgraphExec, CUstream), "move the graph to the GPU now, not at its first launch"),
    # CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)
    DriverFn("cuGraphLaunch", (CUgraphExec, CUstream), "the hot path: queue the whole graph on a stream"),
    # CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)
    DriverFn("cuGraphExecDestroy", (CUgraphExec,), "free the launchable graph"),
    # CUresult cuGraphDestroy(CUgraph hGraph)
    DriverFn("cuGraphDestroy", (CUgraph,), "free the captured graph"),
)

#: The context calls that let another thread issue on this thread's streams (``issue_thread.py``).
CONTEXT_FUNCTIONS: tuple[DriverFn, ...] = (
    # CUresult cuCtxGetCurrent(CUcontext *pctx)
    DriverFn("cuCtxGetCurrent", (ctypes.POINTER(c_void_p),), "the context torch made current on this thread"),
    # CUresult cuCtxSetCurrent(CUcontext ctx)
    DriverFn("cuCtxSetCurrent", (c_void_p,), "make that context current on the issue thread"),
)

#: What :func:`check_cu` asks the driver when a call fails (bound then, never on the way to success).
ERROR_FUNCTIONS: tuple[DriverFn, ...] = (
    # CUresult cuGetErrorString(CUresult error, const char **pStr)
    DriverFn("cuGetErrorString", (CUresult, ctypes.POINTER(ctypes.c_char_p)), "the text of a failed call's CUresult"),
)


class CudaDriverError(WshardingError, RuntimeError):
    """A driver call returned an error code."""


def bind_functions(target: object, table: tuple[DriverFn, ...], path: str = "libcuda.so.1") -> None:
    """Set ``target._<name>`` to each function of ``table`` from the driver library at ``path``,
    typed by ctypes (every driver function returns a CUresult)."""
    lib = ctypes.CDLL(path)
    for fn in table:
        f = getattr(lib, fn.name)
        f.restype = CUresult
        f.argtypes = fn.argtypes
        setattr(target, "_" + fn.name, f)


@functools.cache
def _error_string_fn():
    lib = SimpleNamespace()
    bind_functions(lib, ERROR_FUNCTIONS)
    return lib._cuGetErrorString


def error_string(rc: int) -> str:
    """``cuGetErrorString``'s text for ``rc``; ``""`` where the driver cannot say (no ``libcuda.so.1``
    on this machine, as under the CPU tests' scripted drivers, or a code it does not know)."""
    try:
        text = ctypes.c_char_p()
        if _error_string_fn()(rc, ctypes.byref(text)) or not text.value:
            return ""
    except (OSError, AttributeError):  # no library, or no such function in it
        return ""
    return text.value.decode(errors="replace")


def check_cu(rc: int, what: str) -> None:
    """The one check of every CUDA driver call's result (NCCL's is ``NcclBinding.check``): anything
    but ``CUDA_SUCCESS`` (0) raises :class:`CudaDriverError` naming the call (``what``), the CUresult
    and the driver's text for it. The hot path's calls test ``rc`` themselves and call this only on
    failure, so a successful call costs no second Python call."""
    if rc:
        text = error_string(rc)
        raise CudaDriverError(f"{what} failed with CUresult {rc}" + (f" ({text})" if text else ""))


class CudaDriver:
    """The functions of :data:`FUNCTIONS`, type-checked by ctypes, each returning None or raising;
    those of :data:`GRAPH_FUNCTIONS` and :data:`CONTEXT_FUNCTIONS` as bound (``_cuGraphLaunch``...),
    checked with :func:`check_cu`."""

    def __init__(self, path: str = "libcuda.so.1") -> None:
        self.path = path
        bind_functions(self, FUNCTIONS + GRAPH_FUNCTIONS + CONTEXT_FUNCTIONS, path)

    def event_record(self, event: int, stream: int) -> None:
        rc = self._cuEventRecord(event, stream)
        if rc:
            check_cu(rc, "cuEventRecord")

    def stream_wait_event(self, stream: int, event: int) -> None:
        rc = self._cuStreamWaitEvent(stream, event, 0)
        if rc:
            check_cu(rc, "cuStreamWaitEvent")

    def current_context(self) -> int:
        """The calling thread's current CUDA context (torch's primary context once CUDA is in use)."""
        ctx = c_void_p()
        check_cu(self._cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise CudaDriverError("no CUDA context is current on this thread (use a CUDA tensor first)")
        return ctx.value

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        rc = self._cuMemcpyDtoDAsync_v2(dst, src, nbytes, stream)
        if rc:
            check_cu(rc, f"cuMemcpyDtoDAsync of {nbytes} bytes")


_DRIVER: CudaDriver | None = None


def driver() -> CudaDriver:
    """The process's :class:`CudaDriver`, opened on first use."""
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = CudaDriver()
    return _DRIVER
