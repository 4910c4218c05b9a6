"""``wsharding bench allgather``: the per-layer weight AllGather, measured side by side.

On GPUs, in one run and on the same ranks: our NCCL communicator with CTA policy 2 (copy engine,
symmetric windows, in place), the same with CTA policy 0 (SM kernels), and
``torch.distributed.all_gather_into_tensor`` on a torch NCCL group, for per-layer sizes S from
1 MiB to 512 MiB. Every size is first checked byte for byte, then timed with CUDA events (median
of several repetitions of back-to-back gathers, slowest rank). Reported: algorithm bandwidth S/t,
bus bandwidth (N-1)/N*S/t, and the device-to-device copy ceiling measured on the same machine.
``--overlap`` also times each gather beside an 8192^3 bf16 GEMM (how much of the gather shows).

Without CUDA it says so and runs a small gloo variant on CPU processes, labelled as emulated.
Results go to a JSON file; :mod:`wsharding.lab.viz.comm` draws the figures from it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from wsharding.core.context import RankContext
from wsharding.core.emulation import CPU_EMULATION_NOTE, SHARED_GPU_TORCH_NOTE
from wsharding.core.units import MiB, ceil_div
from wsharding.lab.args.bench_allgather import CPU_ITERS, CPU_SIZES_MIB, DEFAULT_SIZES_MIB
from wsharding.lab.args.bench_allgather import add_arguments as add_arguments
from wsharding.lab.cliargs import (
    MAX_CPU_RANKS,
    MAX_RANKS_PER_GPU,
    InputError,
    check_output_path,
    emit_json,
)
from wsharding.lab.cluster import RankCluster

GPU_NEEDS_CUDA = (
    "the GPU path of this benchmark (our NCCL communicator: symmetric windows, copy-engine AllGather) needs "
    "CUDA, and this machine has none"
)
#: What the CPU variant is, said by its every output.
CPU_VARIANT_NOTE = f"{CPU_EMULATION_NOTE} -- no NCCL, no copy engine"


def impl_name(policy: int | None) -> str:
    return {2: "nccl-ce (policy 2)", 0: "nccl-sm (policy 0)", None: "torch.distributed"}[policy]


def pattern(rank: int, nbytes: int, salt: int, device: torch.device) -> torch.Tensor:
    """Bytes that differ by rank, size and position and are never all zero."""
    i = torch.arange(nbytes, device=device, dtype=torch.int64)
    return ((i * 7 + rank * 13 + salt * 5 + 1) % 251 + 1).to(torch.uint8)


def expected_full(world: int, chunk: int, salt: int, device: torch.device) -> torch.Tensor:
    return torch.cat([pattern(r, chunk, salt, device) for r in range(world)])


def _time_cuda(issue, stream: torch.cuda.Stream, iters: int, reps: int) -> float:
    """Median over ``reps`` of (time of ``iters`` back-to-back issues on ``stream``) / iters, in ms."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(iters):
            issue()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def copy_ceiling(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s = torch.cuda.current_stream(device)
    t = _time_cuda(lambda: b.copy_(a), s, 10, 3)
    return 2 * nbytes / (t * 1e-3) / 1e9


def _gemm_time(device: torch.device, n: int = 8192) -> tuple[Any, float]:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    s = torch.cuda.current_stream(device)
    return (lambda: a @ b), _time_cuda(lambda: a @ b, s, 5, 3)


# ------------------------------------------------------------------------------------------------
# rank tasks (run on every rank of a RankCluster)
# ------------------------------------------------------------------------------------------------
def gpu_bench_rank(
    ctx: RankContext,
    sizes_mib: list[float],
    policies: list[int],
    iters: int,
    reps: int,
    torch_baseline: bool,
    overlap_mib: list[float],
    ce_check_mib: float,
) -> dict[str, Any]:
    """This rank's part of the GPU benchmark (see the module docstring)."""
    import torch.distributed as dist

    from wsharding.accel.nccl import from_context
    from wsharding.accel.nccl.probe import copy_engine_check, own_log_text, policies_in_log

    dev = torch.device("cuda", ctx.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    world, rank = ctx.world_size, ctx.rank
    out: dict[str, Any] = {"rank": rank, "rows": [], "ce_check": {}, "overlap": [], "errors": []}
    sizes = [int(m * MiB) for m in sizes_mib]
    max_size = max(sizes)
    if rank == 0:
        out["copy_ceiling_GBps"] = copy_ceiling(dev)
    gemm, gemm_ms = _gemm_time(dev) if overlap_mib else (None, None)
    out["gemm_ms"] = gemm_ms

    def measure(impl: str, policy: int | None, full_all: torch.Tensor, gather, stream, info: dict) -> None:
        for salt, size in enumerate(sizes):
            chunk_n = size // world
            full = full_all[:size]
            chunk = full[rank * chunk_n:(rank + 1) * chunk_n]
            full.fill_(0xAB)  # poison: every byte must be written by the gather
            chunk.copy_(pattern(rank, chunk_n, salt, dev))
            gather(full, chunk).synchronize()
            torch.cuda.synchronize(dev)
            bad = int((full != expected_full(world, chunk_n, salt, dev)).sum())
            for _ in range(2):
                gather(full, chunk)
            torch.cuda.synchronize(dev)
            ctx_barrier()
            ms = _time_cuda(lambda f=full, c=chunk: gather(f, c), stream, iters, reps)
            row = {"impl": impl, "policy": policy, "size_bytes": size, "time_ms": ms, "mismatched_bytes": bad}
            row.update(info)
            out["rows"].append(row)
            if size / MiB in overlap_mib and gemm is not None:
                out["overlap"].append(_overlap(impl, policy, size, full, chunk, gather, stream, gemm, dev))

    def ctx_barrier() -> None:
        if world > 1:
            dist.barrier()

    for policy in policies:
        comm = from_context(ctx, device=dev, cta_policy=policy, timeout_s=120)
        try:
            full_all = comm.alloc(max_size, tag="bench.full")
            comm.register_all()
            gather = lambda f, c, comm=comm: comm.all_gather_into(f, c, async_op=True)  # noqa: E731
            measure(impl_name(policy), policy, full_all, gather, comm.stream, {"mode": comm.mode})
            probe_size = min(int(ce_check_mib * MiB), max_size)
            n = probe_size // world
            out["ce_check"][str(policy)] = copy_engine_check(comm, full_all[:probe_size],
                                                             full_all[rank * n:(rank + 1) * n])
            out["mode"], out["emulation"], out["nccl"] = comm.mode, comm.emulation, comm.library.describe()
            out["ranks_per_gpu"] = comm.ranks_per_gpu
        finally:
            comm.close()
    out["nccl_log_policies"] = policies_in_log(own_log_text())

    if torch_baseline:
        try:
            _torch_baseline(ctx, dev, sizes, measure)
        except Exception as e:  # noqa: BLE001 - the baseline failing must not hide our numbers
            out["errors"].append(f"torch.distributed NCCL baseline: {type(e).__name__}: {str(e)[:400]}")
    return out


def _torch_baseline(ctx: RankContext, dev: torch.device, sizes: list[int], measure) -> None:
    import torch.distributed as dist

    from wsharding.core.torch_backend import all_gather_single

    group = ctx.store.get("_bench_nccl_group")
    if group is None:
        group = ctx.store["_bench_nccl_group"] = dist.new_group(backend="nccl") if ctx.backend == "gloo" else None
    stream = torch.cuda.Stream(dev)
    full_all = torch.empty(max(sizes), dtype=torch.uint8, device=dev)

    class _H:
        def __init__(self, ev):
            self.ev = ev

        def synchronize(self):
            self.ev.synchronize()

    def gather(f, c):
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            all_gather_single(f, c, group=group)
        ev = torch.cuda.Event()
        ev.record(stream)
        return _H(ev)

    from torch.cuda import nccl as tnccl

    measure(impl_name(None), None, full_all, gather, stream, {"torch_nccl": ".".join(map(str, tnccl.version()))})


def _overlap(impl, policy, size, full, chunk, gather, stream, gemm, dev) -> dict[str, Any]:
    """Gather alone, GEMM alone, both (GEMM on the current stream, gather on its own stream)."""
    cur = torch.cuda.current_stream(dev)

    def both():
        gather(full, chunk)
        gemm()
        cur.wait_stream(stream)

    alone_g = _time_cuda(lambda: gather(full, chunk), stream, 10, 3)
    alone_m = _time_cuda(gemm, cur, 10, 3)
    together = _time_cuda(both, cur, 10, 3)
    exposed = max(0.0, together - alone_m)
    return {"impl": impl, "policy": policy, "size_bytes": size, "gather_ms": alone_g, "gemm_ms": alone_m,
            "both_ms": together, "exposed_ms": exposed, "exposed_fraction": exposed / alone_g if alone_g else None}


def cpu_bench_rank(ctx: RankContext, sizes_mib: list[float], iters: int, reps: int = 3) -> dict[str, Any]:
    """The CPU variant: torch.distributed gloo between CPU processes (emulated, not NCCL). Each size
    is timed ``reps`` times (``iters`` gathers each): CPU times are noisy, and the spread shows it."""
    comm = ctx.comm
    rows = []
    for salt, m in enumerate(sizes_mib):
        size = int(m * MiB) // ctx.world_size * ctx.world_size
        chunk_n = size // ctx.world_size
        full = comm.alloc(size)
        chunk = full[ctx.rank * chunk_n:(ctx.rank + 1) * chunk_n]
        full.fill_(0xAB)
        chunk.copy_(pattern(ctx.rank, chunk_n, salt, torch.device("cpu")))
        comm.all_gather_into(full, chunk)
        bad = int((full != expected_full(ctx.world_size, chunk_n, salt, torch.device("cpu"))).sum())
        samples = []
        for _ in range(reps):
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                comm.all_gather_into(full, chunk)
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
        rows.append({"impl": "torch.distributed gloo (CPU)", "policy": None, "size_bytes": size,
                     "time_ms": statistics.median(samples), "time_min_ms": min(samples), "time_max_ms": max(samples),
                     "reps": reps, "mismatched_bytes": bad, "mode": ctx.mode})
    return {"rank": ctx.rank, "rows": rows, "mode": ctx.mode, "emulation": ctx.emulation}


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def merge(per_rank: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """One row per (impl, size): the slowest rank's time (a collective is as slow as its last
    rank) with that rank's spread when it has one, bandwidths from it, mismatches summed over ranks."""
    merged: dict[tuple, dict[str, Any]] = {}
    for r in per_rank:
        for row in r["rows"]:
            key = (row["impl"], row["size_bytes"])
            m = merged.setdefault(key, dict(row, mismatched_bytes=0, time_ms=0.0))
            if row["time_ms"] >= m["time_ms"]:
                m.update({k: row[k] for k in ("time_ms", "time_min_ms", "time_max_ms") if k in row})
            m["mismatched_bytes"] += row["mismatched_bytes"]
    for m in merged.values():
        t = m["time_ms"] * 1e-3
        m["algbw_GBps"] = m["size_bytes"] / t / 1e9
        m["busbw_GBps"] = (world - 1) / world * m["size_bytes"] / t / 1e9
    return sorted(merged.values(), key=lambda m: (m["impl"], m["size_bytes"]))


def machine_label() -> str:
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}" if names else "GPU"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run_gpu(ranks: int, ranks_per_gpu: int, sizes_mib: list[float], policies: list[int], iters: int = 20,
            reps: int = 5, torch_baseline: bool = True, overlap_mib: list[float] | None = None,
            ce_check_mib: float = 32, nccl_log: bool = True) -> dict[str, Any]:
    """Run the GPU benchmark on ``ranks`` processes (gloo CPU group, our NCCL on the GPUs)."""
    if ranks_per_gpu > 1 and torch_baseline:
        print(f"NOTE: {SHARED_GPU_TORCH_NOTE}.")  # once, here, instead of NCCL's error from every rank
        torch_baseline = False
    logdir = tempfile.mkdtemp(prefix="wsharding-nccl-log-")
    env = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"} if ranks_per_gpu > 1 else {}
    if nccl_log:
        from wsharding.accel.nccl.probe import log_environment

        env.update(log_environment(logdir))
    with RankCluster(ranks, backend="gloo", task_timeout=590, collective_timeout=300, env=env) as cluster:
        per_rank = cluster.run(gpu_bench_rank, sizes_mib, policies, iters, reps, torch_baseline,
                               list(overlap_mib or []), ce_check_mib)
    r0 = per_rank[0]
    return {
        "benchmark": "allgather", "machine": machine_label(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "world_size": ranks, "ranks_per_gpu": r0.get("ranks_per_gpu", ranks_per_gpu), "mode": r0.get("mode"),
        "emulation": r0.get("emulation", ""), "nccl": r0.get("nccl"), "torch": torch.__version__,
        "cuda": torch.version.cuda, "copy_ceiling_GBps": r0.get("copy_ceiling_GBps"), "gemm_ms": r0.get("gemm_ms"),
        "rows": merge(per_rank, ranks), "ce_check": {r["rank"]: r["ce_check"] for r in per_rank},
        "nccl_log_policies": {r["rank"]: r["nccl_log_policies"] for r in per_rank},
        "overlap": r0["overlap"], "errors": sorted({e for r in per_rank for e in r["errors"]}),
        "command": " ".join(sys.argv),
        "env": {k: os.environ[k] for k in ("WSHARDING_NCCL_LIBRARY", "LD_PRELOAD", "NCCL_MULTI_RANK_GPU_ENABLE",
                                           "NCCL_CTA_POLICY") if k in os.environ},
    }


def run_cpu(ranks: int, sizes_mib: list[float], iters: int = 5, cluster: RankCluster | None = None,
            reps: int = 3) -> dict[str, Any]:
    """The gloo variant on CPU processes, ``reps`` timings per size; every output says it is emulated."""
    own = cluster is None
    cluster = cluster or RankCluster(ranks, backend="gloo")
    try:
        per_rank = cluster.run(cpu_bench_rank, sizes_mib, iters, reps)
    finally:
        if own:
            cluster.close()
    return {
        "benchmark": "allgather", "machine": machine_label(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "world_size": cluster.world_size, "ranks_per_gpu": None, "mode": per_rank[0]["mode"],
        "emulation": f"{CPU_VARIANT_NOTE}: {GPU_NEEDS_CUDA}",
        "nccl": None, "torch": torch.__version__, "cuda": None, "copy_ceiling_GBps": None,
        "rows": merge(per_rank, cluster.world_size), "ce_check": {}, "overlap": [], "errors": [],
        "command": " ".join(sys.argv),
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [f"AllGather benchmark -- {result['machine']}, {result['date']}, mode {result['mode']}, "
             f"world size {result['world_size']}"]
    if result.get("emulation"):
        lines.append(f"NOTE: {result['emulation']}")
    if result.get("nccl"):
        lines.append(f"NCCL {result['nccl']['version']} from {result['nccl']['path']} ({result['nccl']['source']})")
    if result.get("copy_ceiling_GBps"):
        lines.append(f"device-to-device copy ceiling: {result['copy_ceiling_GBps']:.0f} GB/s (read + write)")
    spread = any("time_min_ms" in r for r in result["rows"])
    ms_head, w = ("ms: median (min-max)", 24) if spread else ("ms", 9)
    lines.append(f"{'impl':<28} {'MiB':>8} {ms_head:>{w}} {'algbw GB/s':>11} {'busbw GB/s':>11} "
                 f"{'bad bytes':>10}")
    for r in result["rows"]:
        ms = f"{r['time_ms']:.3f}"
        if "time_min_ms" in r:
            ms += f" ({r['time_min_ms']:.3f}-{r['time_max_ms']:.3f})"
        lines.append(f"{r['impl']:<28} {r['size_bytes'] / MiB:>8.2f} {ms:>{w}} {r['algbw_GBps']:>11.1f} "
                     f"{r['busbw_GBps']:>11.1f} {r['mismatched_bytes']:>10}")
    if spread:
        reps = max(r.get("reps", 1) for r in result["rows"])
        lines.append(f"(each size timed {reps} times on every rank; the slowest rank's median and its min-max: "
                     "on CPU processes the spread is noise, not a property of the gather)")
    for rank, chk in sorted((result.get("ce_check") or {}).items())[:1]:
        for pol, c in chk.items():
            lines.append(f"rank {rank} policy {pol}: copy_engine={c['copy_engine']} nccl_kernels={c['nccl_kernels']} "
                         f"copies={c['copies']}")
    if result.get("nccl_log_policies"):
        lines.append(f"NCCL log 'CTA policy flags set to' per rank: {result['nccl_log_policies']}")
    for o in result.get("overlap", []):
        lines.append(f"overlap {o['impl']:<20} {o['size_bytes'] / MiB:>6.0f} MiB: gather {o['gather_ms']:.3f} ms, "
                     f"GEMM {o['gemm_ms']:.3f} ms, both {o['both_ms']:.3f} ms, exposed {o['exposed_ms']:.3f} ms")
    for e in result.get("errors", []):
        lines.append(f"ERROR {e}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    check_output_path(args.json or "", "--json")
    if args.cpu or not torch.cuda.is_available():
        if args.ranks and args.ranks > MAX_CPU_RANKS:
            raise InputError(f"--ranks {args.ranks}: at most {MAX_CPU_RANKS} CPU rank processes")
        # the CPU variant has no GEMM and no GPUs to share: these options would be silently dropped
        why = "with --cpu the gloo variant runs" if args.cpu else "this machine has no CUDA GPU"
        if args.overlap:
            raise InputError(f"--overlap times gathers beside a bf16 GEMM on GPUs, and {why}; leave --overlap out")
        if args.ranks_per_gpu:
            raise InputError(f"--ranks-per-gpu {args.ranks_per_gpu} places ranks on GPUs, and {why}; leave "
                             "--ranks-per-gpu out")
        if not args.cpu:
            print(f"NOTE: {GPU_NEEDS_CUDA}. Running the CPU gloo variant instead ({CPU_VARIANT_NOTE}).",
                  file=sys.stderr if args.json == "-" else sys.stdout)
        result = run_cpu(args.ranks or 2, args.sizes or CPU_SIZES_MIB, iters=args.iters or CPU_ITERS,
                         reps=args.reps or 3)
    else:
        gpus = torch.cuda.device_count()
        ranks = args.ranks or gpus
        rpg = args.ranks_per_gpu or ceil_div(ranks, gpus)
        if rpg * gpus < ranks:
            raise InputError(f"--ranks {ranks} with --ranks-per-gpu {rpg} needs {ceil_div(ranks, rpg)} GPUs; "
                             f"this machine has {gpus}")
        if rpg > MAX_RANKS_PER_GPU:
            raise InputError(f"--ranks {ranks} would put {rpg} ranks on one GPU; at most {MAX_RANKS_PER_GPU}")
        result = run_gpu(ranks, rpg, args.sizes or DEFAULT_SIZES_MIB, args.policies, iters=args.iters or 20,
                         reps=args.reps or 5, torch_baseline=not args.no_torch, overlap_mib=args.overlap)
    if args.json != "-":
        print(format_table(result))
    written = emit_json(result, args.json)
    if written:
        print(f"wrote {written}")
    bad = sum(r["mismatched_bytes"] for r in result["rows"])
    return 1 if bad else 0
