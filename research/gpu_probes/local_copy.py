"""Does a device-to-device copy on a side stream hold up the GEMMs on the compute stream?

    python3 research/gpu_probes/local_copy.py        # one GPU; prints JSON

Why: on two H200s, the compute stream of a sharded step sat idle for the whole ~100 us of each
layer's own-chunk copy (218 MB, ``cuMemcpyDtoDAsync`` on the copy stream; research/gpu_probes/
contention.py): a same-device copy runs on the SMs at full HBM speed, and the next GEMM waited for
it. Measured here: a GEMM loop alone, then the same loop with a 218 MB copy issued beside it as
one ``cuMemcpyDtoDAsync``, as 64 pieces, and as ``cuMemcpyBatchAsync`` with the
prefer-overlap-with-compute hint (CUDA >= 12.8), each a few times.
"""

from __future__ import annotations

import ctypes

import torch
from probe_report import report

SIZE = 218 << 20
GEMMS = 6


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", ctypes.c_uint)]


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cu = ctypes.CDLL("libcuda.so.1")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    src = torch.empty(SIZE, dtype=torch.uint8, device=dev)
    dst = torch.empty(SIZE, dtype=torch.uint8, device=dev)
    compute = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    h = ctypes.c_void_p(side.cuda_stream)

    def plain() -> None:
        assert cu.cuMemcpyDtoDAsync_v2(ctypes.c_uint64(dst.data_ptr()), ctypes.c_uint64(src.data_ptr()),
                                       ctypes.c_size_t(SIZE), h) == 0

    def pieces(n: int = 64) -> None:
        step = SIZE // n
        for i in range(n):
            assert cu.cuMemcpyDtoDAsync_v2(ctypes.c_uint64(dst.data_ptr() + i * step),
                                           ctypes.c_uint64(src.data_ptr() + i * step), ctypes.c_size_t(step), h) == 0

    attrs = MemcpyAttributes(1, MemLocation(1, 0), MemLocation(1, 0), 1)  # stream order, device 0, prefer overlap
    dsts = (ctypes.c_uint64 * 1)(dst.data_ptr())
    srcs = (ctypes.c_uint64 * 1)(src.data_ptr())
    sizes = (ctypes.c_size_t * 1)(SIZE)
    idxs = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)

    def batch() -> None:
        if hasattr(cu, "cuMemcpyBatchAsync_v2"):
            rc = cu.cuMemcpyBatchAsync_v2(dsts, srcs, sizes, ctypes.c_size_t(1), ctypes.byref(attrs), idxs,
                                          ctypes.c_size_t(1), h)
        else:
            rc = cu.cuMemcpyBatchAsync(dsts, srcs, sizes, ctypes.c_size_t(1), ctypes.byref(attrs), idxs,
                                       ctypes.c_size_t(1), ctypes.byref(fail), h)
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync: CUresult {rc}")

    def run(copy) -> dict:
        torch.cuda.synchronize()
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record(compute)
        side.wait_event(s0)
        for k in range(GEMMS):
            torch.mm(a, b)
            if copy is not None and k == 1:  # the copy starts while GEMM 2 runs
                c0.record(side)
                copy()
                c1.record(side)
        s1.record(compute)
        torch.cuda.synchronize()
        return {"gemms_ms": s0.elapsed_time(s1), "copy_ms": c0.elapsed_time(c1) if copy is not None else None}

    for _ in range(3):
        run(None)
    out = {"size_bytes": SIZE, "gemms": GEMMS, "cuda_driver": torch.version.cuda}
    for name, fn in (("alone", None), ("plain", plain), ("pieces64", pieces), ("batch_prefer_overlap", batch),
                     ("alone_again", None)):
        try:
            out[name] = [run(fn) for _ in range(4)]
        except Exception as e:  # noqa: BLE001 - a probe reports what failed
            out[name] = f"{type(e).__name__}: {e}"
    report("local_copy_probe.json", out)


if __name__ == "__main__":
    main()
