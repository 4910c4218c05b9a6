"""``wsharding soak``: many steps and a few faults, to show that nothing drifts and nothing hangs.

**The soak.** Every rank builds the decoder twice (replicated, and sharded over the group) and runs
``steps`` steps whose token count changes every step and differs between ranks, with idle ranks
(0 tokens: the one-token dummy step). Each step the sharded output must equal the replicated one
bit for bit, every step issues the same number of gathers, and from the end of the warm-up to the
last step the rank's open files and threads do not change and its memory does not grow: on CPU
ranks the bytes malloc has handed out and not got back (glibc's ``mallinfo2``; within
:data:`HEAP_SLACK`), the memory blocks of Python objects (within :data:`PY_BLOCKS_SLACK`) and the RSS (within :data:`RSS_SLACK`, since the allocator keeps pages it may
reuse), on GPUs ``torch.cuda.memory_allocated``, exactly.

[Note: the flight recorder] torch records the last collectives of every process group in a ring
(``TORCH_FR_BUFFER_SIZE``, 2000 entries by default). Until the ring is full it grows by a few KiB per
step -- bounded, but over a short soak it looks like a leak. The soak's ranks use a ring of
:data:`FR_ENTRIES`, full long before the warm-up ends.

**The faults.** On a fresh cluster each: one rank is killed in the middle of a step, skips a step,
or raises in the middle of a step. Every other rank must then fail with an error of its own (a
gather that did not complete) within the collective timeout -- not hang -- and no process may be
left afterwards.

CPU ranks are emulated GPUs (gloo): every line of the report says so.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.core.runner import aligned_forward
from wsharding.core.units import KiB, MiB
from wsharding.lab.args.soak import MIN_STEPS as MIN_STEPS
from wsharding.lab.args.soak import WARMUP
from wsharding.lab.args.soak import add_arguments as add_arguments
from wsharding.lab.cliargs import InputError, check_output_path, emit_json
from wsharding.lab.cluster import RankCluster, RemoteError, TaskTimeout, WorkerDied, choose_backend
from wsharding.lab.memory import MemoryCheckError, check_demo_fits
from wsharding.models import build_pair, decoder_config

#: Bytes in use by malloc may move by what Python's and torch's free lists keep; a leak of a few
#: hundred bytes per step is larger than this over a soak of a few hundred steps.
HEAP_SLACK = 64 * KiB
#: Python objects live in pymalloc's arenas, which malloc does not see: their blocks are counted apart
#: (``sys.getallocatedblocks``). A soak's own bookkeeping moves them by a few dozen.
PY_BLOCKS_SLACK = 512
#: RSS may also move by the pages the allocator keeps for reuse.
RSS_SLACK = 2 * MiB
#: [Note: the flight recorder]
FR_ENTRIES = 64
#: A fault run's errors must arrive within the collective timeout plus this (building the models
#: and the steps before the fault, on a loaded machine).
FAULT_MARGIN_S = 10.0
#: The three fault runs.
FAULTS = ("kill", "skip", "raise")


def tokens_at(rank: int, step: int) -> int:
    """Tokens of ``rank`` at ``step``: 1..16 and changing every step; 0 (idle) every fifth step of a rank."""
    if (step + rank) % 5 == 0:
        return 0
    return 1 + (7 * step + 13 * rank) % 16


class _MallInfo2(ctypes.Structure):
    # struct mallinfo2 of <malloc.h> (glibc >= 2.33): ten size_t fields
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_in_use() -> int | None:
    """Bytes malloc has handed out and not got back (``uordblks + hblkhd``), or None without glibc."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    m = fn()
    return m.uordblks + m.hblkhd


def _proc_counts() -> dict[str, int | None]:
    """RSS bytes, heap bytes in use, Python objects' memory blocks, open file descriptors and
    threads of this process."""
    gc.collect()
    return {
        "rss": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"),
        "heap": heap_in_use(),
        "py_blocks": sys.getallocatedblocks(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(Path("/proc/self/status").read_text().split("Threads:")[1].split()[0]),
    }


class DeliberateFault(WshardingError, RuntimeError):
    """The error a fault run's bad rank raises on purpose in the middle of a step."""


class _Fault:
    """A forward pre-hook: does the fault in the middle of a step."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise DeliberateFault("deliberate fault: this rank raised in the middle of a step")


def soak_rank(ctx: RankContext, preset: str = "tiny", steps: int = 1000, *, comm: str = "torch", warmup: int = WARMUP,
              fault: str | None = None, fault_step: int = 3, bad_rank: int = 1,
              keep_traces: bool = False, map_own_chunk: bool | str = "auto") -> dict[str, Any]:
    """One rank of the soak (``fault=None``) or of a fault run (``fault`` in :data:`FAULTS`: rank
    ``bad_rank`` does it at ``fault_step``). Returns per-step equality, gathers and the resource
    counts at the end of the warm-up and at the end.

    ``keep_traces``: a leak on purpose (every step's trace is kept), to show the check catches one.
    ``map_own_chunk``: :class:`~wsharding.core.sharding.WeightSharding`'s (``"auto"``, the default, keeps plain
    slots for ``tiny``, whose layers are smaller than the 2 MiB page: True maps them anyway)."""
    if fault is not None and fault not in FAULTS:
        raise InvalidArgument(f"fault: {fault!r} is not one of {FAULTS}")
    if not 0 < warmup < steps:
        raise InvalidArgument(f"warmup: need 0 < warmup ({warmup}) < steps ({steps})")
    cfg = decoder_config(preset)
    if comm == "nccl":
        from wsharding.accel.nccl import from_context

        # our communicator gives up on a gather after its own timeout: the cluster's collective timeout,
        # so that a fault run's errors arrive within it (one soak or fault run per fresh cluster)
        c = from_context(ctx, timeout_s=ctx.timeout.total_seconds())
    else:
        c = shard_comm_for(ctx, comm)
    replicated, sharded = build_pair(cfg, c, trace=keep_traces, map_own_chunk=map_own_chunk)
    planner = sharded.planner
    dev = c.device
    cuda = dev.type == "cuda"
    gen = torch.Generator().manual_seed(ctx.rank)
    unequal: list[int] = []
    gathers: set[int] = set()
    idle_steps = 0
    counts: dict[str, Any] = {}
    faulty = fault is not None and ctx.rank == bad_rank
    with torch.no_grad():
        for s in range(steps):
            if faulty and s == fault_step and fault == "skip":
                continue
            hook = None
            if faulty and s == fault_step:
                hook = sharded.layers[cfg.layers // 2].register_forward_pre_hook(_Fault(fault))
            n = tokens_at(ctx.rank, s)
            x = torch.randint(0, cfg.vocab, (n,), generator=gen).to(dev)
            out = aligned_forward(sharded, x, sharded.dummy_tokens)
            if hook is not None:
                hook.remove()
            gathers.add(planner.gathers_this_step)
            if out is None:
                idle_steps += 1
            elif not torch.equal(out, replicated(x)):
                unequal.append(s)
            if s in (warmup - 1, steps - 1):
                # this step's input and output differ in size from step to step (the token count
                # changes): measured while still held, they would read as growth or shrinkage
                del x, out
                if cuda:
                    torch.cuda.synchronize(dev)
                counts["warm" if s == warmup - 1 else "end"] = dict(
                    _proc_counts(), cuda_allocated=torch.cuda.memory_allocated(dev) if cuda else None)
    return {
        "rank": ctx.rank, "mode": c.mode, "emulation": c.emulation or ctx.emulation,
        "steps": steps, "idle_steps": idle_steps, "unequal_steps": unequal, "gathers_per_step": sorted(gathers),
        "sharded_layers": sharded.weight_sharding.sharded_layer_ids, "counts": counts,
        "map_own_chunk": sharded.weight_sharding.map_own_chunk,
    }


def growth(result: dict[str, Any]) -> dict[str, int | None]:
    """What grew on one rank between the end of the warm-up and the end of the soak."""
    w, e = result["counts"]["warm"], result["counts"]["end"]
    return {k: (None if w[k] is None else e[k] - w[k]) for k in ("rss", "heap", "py_blocks", "fds", "threads", "cuda_allocated")}


def soak_ok(results: list[dict[str, Any]]) -> list[str]:
    """The soak's verdict: an empty list, or one line per broken promise."""
    bad = []
    for r in results:
        g = growth(r)
        if r["unequal_steps"]:
            bad.append(f"rank {r['rank']}: outputs differ from the replicated model at steps {r['unequal_steps'][:10]}")
        if len(r["gathers_per_step"]) != 1 or r["gathers_per_step"][0] != len(r["sharded_layers"]):
            bad.append(f"rank {r['rank']}: gathers per step {r['gathers_per_step']}, expected {len(r['sharded_layers'])}")
        if g["fds"] or g["threads"]:
            bad.append(f"rank {r['rank']}: open files grew by {g['fds']}, threads by {g['threads']}")
        if g["cuda_allocated"]:
            bad.append(f"rank {r['rank']}: GPU memory allocated grew by {g['cuda_allocated']} B")
        if g["cuda_allocated"] is None and g["heap"] is not None and g["heap"] > HEAP_SLACK:
            bad.append(f"rank {r['rank']}: heap in use grew by {g['heap'] / KiB:.1f} KiB (slack {HEAP_SLACK / KiB:.0f} KiB)")
        if g["py_blocks"] > PY_BLOCKS_SLACK:
            bad.append(f"rank {r['rank']}: Python objects grew by {g['py_blocks']} blocks (slack {PY_BLOCKS_SLACK})")
        if g["cuda_allocated"] is None and g["rss"] > RSS_SLACK:
            bad.append(f"rank {r['rank']}: RSS grew by {g['rss'] / MiB:.2f} MiB (slack {RSS_SLACK / MiB:.0f} MiB)")
    return bad


def run_soak(ranks: int = 3, steps: int = 1000, *, preset: str = "tiny", backend: str = "gloo", comm: str = "torch",
             warmup: int = WARMUP, keep_traces: bool = False, map_own_chunk: bool | str = "auto") -> list[dict[str, Any]]:
    """The soak on a cluster of its own; returns every rank's result."""
    env = {"TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES)}  # [Note: the flight recorder]
    with RankCluster(ranks, backend=backend, task_timeout=max(600.0, steps * 2.0), env=env) as cluster:
        return cluster.run(soak_rank, preset, steps, comm=comm, warmup=warmup, keep_traces=keep_traces,
                           map_own_chunk=map_own_chunk)


def run_fault(fault: str, ranks: int = 3, *, preset: str = "tiny", backend: str = "gloo", comm: str = "torch",
              collective_timeout: float = 5.0, steps: int = 8, map_own_chunk: bool | str = "auto") -> dict[str, Any]:
    """One fault run on a fresh cluster: what every rank said, how long it took, and which rank
    processes were still alive afterwards (must be none)."""
    bad_rank = ranks // 2
    cluster = RankCluster(ranks, backend=backend, collective_timeout=collective_timeout, task_timeout=120)
    cluster.start()
    pids = cluster.pids
    errors: dict[int, str] = {}
    kind = "none"
    t0 = time.monotonic()
    try:
        cluster.run_with(soak_rank, (preset, steps), {"comm": comm, "warmup": 1, "fault": fault, "bad_rank": bad_rank,
                                                      "map_own_chunk": map_own_chunk},
                         grace=collective_timeout + FAULT_MARGIN_S)
    except (WorkerDied, RemoteError) as e:
        kind = f"rank {e.rank} {'died' if isinstance(e, WorkerDied) else 'raised'}"
        errors = {r: f"{t}: {m}" for r, (t, m) in e.errors.items()}
    except TaskTimeout as e:  # a hang: the verdict reports the silent ranks
        kind = f"timeout: {e}"
    elapsed = time.monotonic() - t0
    cluster.close()
    time.sleep(0.2)
    left = [pid for pid in pids if _alive(pid)]
    return {"fault": fault, "bad_rank": bad_rank, "ranks": ranks, "outcome": kind, "errors": errors,
            "seconds": elapsed, "collective_timeout": collective_timeout, "processes_left": left,
            "emulation": cluster.emulation}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def fault_ok(r: dict[str, Any]) -> list[str]:
    """A fault run's verdict: every rank but the faulty one failed with its own error, in time, and
    no process is left."""
    bad = []
    others = [k for k in range(r["ranks"]) if k != r["bad_rank"]]
    silent = [k for k in others if k not in r["errors"]]
    if silent:
        bad.append(f"{r['fault']}: ranks {silent} gave no error")
    if r["seconds"] > r["collective_timeout"] + FAULT_MARGIN_S:
        bad.append(f"{r['fault']}: the errors took {r['seconds']:.1f} s (timeout {r['collective_timeout']} s)")
    if r["processes_left"]:
        bad.append(f"{r['fault']}: processes left behind: {r['processes_left']}")
    return bad


def format_report(results: list[dict[str, Any]], faults: list[dict[str, Any]]) -> str:
    r0 = results[0] if results else None
    lines = []
    if r0 is not None:
        lines.append(f"wsharding soak -- mode {r0['mode']}, {len(results)} ranks, {r0['steps']} steps")
        if r0["emulation"]:
            lines.append(f"  NOTE: {r0['emulation']}")
        for r in results:
            g = growth(r)
            mem = (f"GPU allocated {g['cuda_allocated']:+d} B" if g["cuda_allocated"] is not None
                   else f"RSS {g['rss'] / MiB:+.2f} MiB, heap {(g['heap'] or 0) / KiB:+.1f} KiB")
            mem += f", Python blocks {g['py_blocks']:+d}"
            lines.append(f"  rank {r['rank']}: unequal steps {len(r['unequal_steps'])}, idle steps {r['idle_steps']}, "
                         f"gathers/step {r['gathers_per_step']}, {mem}, fds {g['fds']:+d}, threads {g['threads']:+d}")
    for f in faults:
        lines.append(f"  fault {f['fault']:5s} on rank {f['bad_rank']}: {f['outcome']}; errors on ranks "
                     f"{sorted(f['errors'])} in {f['seconds']:.1f} s; processes left {f['processes_left']}")
    verdict = (soak_ok(results) if results else []) + [x for f in faults for x in fault_ok(f)]
    lines.append("  verdict: " + ("ok" if not verdict else "FAILED\n    " + "\n    ".join(verdict)))
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse, before any rank starts, what cannot run: an output path that cannot be written, and a
    preset whose two models per rank do not fit in memory (the demo's check: a soak rank builds what a
    demo rank builds)."""
    check_output_path(args.json or "", "--json")
    devices = choose_backend(args.ranks, args.backend)[1]
    try:
        check_demo_fits(args.preset, args.ranks, devices)
    except MemoryCheckError as e:
        raise InputError(f"--preset {args.preset} --ranks {args.ranks}: a soak rank holds what a demo rank holds "
                         f"(the replicated model and its sharded twin), and {e}") from None


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    results = run_soak(args.ranks, args.steps, preset=args.preset, backend=args.backend, comm=args.comm)
    faults = [] if args.no_faults else [run_fault(f, args.ranks, preset=args.preset, backend=args.backend,
                                                  comm=args.comm) for f in FAULTS]
    if args.json != "-":
        print(format_report(results, faults))
    written = emit_json({"soak": results, "faults": faults}, args.json)
    if written:
        print(f"  report: {written}")
    return 0 if not soak_ok(results) and not any(fault_ok(f) for f in faults) else 1
