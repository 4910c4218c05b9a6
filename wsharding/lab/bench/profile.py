"""``wsharding bench profile``: a per-stream timeline of one sharded decoder step, from a real profile.

Each rank runs a few steps of the sharded decoder under ``torch.profiler`` (CPU and, on GPUs, CUDA
activity) and keeps the last profiled step: every interval the device ran -- kernels and memcpys,
with their name and stream -- and the host's lane (the layers and the planner's calls, labelled here
with ``record_function`` around the layers and the planner's calls, not in the package's core).
Times are microseconds from the step's start. Each interval gets a class:

* ``gather``: NCCL kernels, and memcpys on a stream that is not the compute stream (our
  communicator's gather stream moves the chunks by copy-engine memcpys);
* ``compute``: the other kernels on the compute stream (the GEMMs, norms, attention);
* ``copy``: memcpys and memsets on the compute stream, and kernels on other streams.

On CPU ranks there are no streams: the lanes are the threads of each rank process, the intervals
their outermost operators. The model's thread's are classed by name (:data:`GATHER_WORDS`: issuing
a gather; :data:`COPY_WORDS`); every operator of gloo's worker threads belongs to a gather (the
copies in and out of its buffers; the transfer itself is no operator and shows as the model's wait
in ``planner.wait_ready_once``). The report carries the run's emulation words.

The device's intervals are found in the profiler's Chrome trace (``export_chrome_trace``): it
holds every device activity with its stream and, on the same clock, the host's labels that bound the
step, in the same form on every GPU and torch version that writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.core.observe import StepObserver, observing
from wsharding.io_checks import read_saved_report
from wsharding.lab.args.bench_profile import add_arguments as add_arguments
from wsharding.lab.bench.ranks import auto_comm, bench_cluster
from wsharding.lab.bench.report import json_path, save_report
from wsharding.lab.cliargs import check_output_path
from wsharding.models import ToyDecoder, decoder_config
from wsharding.runtime import gpu_count, in_ci

#: The labels the bench puts around a step, a layer and a planner call (``record_function``).
STEP_LABEL = "wsharding.step"
LAYER_LABEL = "layer"
PLANNER_LABEL = "planner."
#: The classes of an interval, in the order a figure's legend lists them.
CLASSES = ("gather", "compute", "copy", "layer", "planner")
#: CPU operator names (lower case) that are a gather or its wait.
GATHER_WORDS = ("gloo", "c10d", "all_gather", "allgather", "nccl", "wait")
#: CPU operator names (lower case) that move bytes without computing.
COPY_WORDS = ("copy", "cat", "clone", "_to_copy", "contiguous", "narrow", "index_select", "fill_", "zero_")
#: The longest kernel name kept (template-heavy GEMM names run to hundreds of characters).
NAME_CHARS = 96
#: The columns of an interval row in the report.
COLUMNS = ("start_us", "end_us", "class", "name")


# ---- labels around the layers and the planner's calls ----------------------------------------------------
@contextmanager
def labelled(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every layer of ``model`` runs inside ``record_function("layer i")`` and every
    planner call (:data:`~wsharding.core.observe.CALLS`) inside ``"planner.<call>"``, by an observer:
    the host lane of the timeline. Hooks and the observer are removed on exit."""
    handles = []
    open_ranges: dict[int, Any] = {}

    def enter(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            rf = torch.profiler.record_function(f"{LAYER_LABEL} {i}")
            rf.__enter__()
            open_ranges[i] = rf
        return hook

    def leave(i: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: Any) -> None:
            rf = open_ranges.pop(i, None)
            if rf is not None:
                rf.__exit__(None, None, None)
        return hook

    for i, layer in enumerate(model.layers):
        handles.append(layer.register_forward_pre_hook(enter(i)))
        handles.append(layer.register_forward_hook(leave(i)))
    planner = getattr(model, "planner", None)
    labels = PlannerLabels()
    try:
        with observing(planner.observers if planner is not None else [], labels):
            yield
    finally:
        for h in handles:
            h.remove()
        for rf in open_ranges.values():
            rf.__exit__(None, None, None)
        labels.close()


class PlannerLabels(StepObserver):
    """An observer ([Note: observers] in ``wsharding/core/observe.py``) that runs every planner call
    inside ``record_function("planner.<call>")``."""

    def __init__(self) -> None:
        self.open: list[Any] = []

    def call(self, name: str) -> None:
        rf = torch.profiler.record_function(PLANNER_LABEL + name)
        rf.__enter__()
        self.open.append(rf)

    def returned(self, name: str) -> None:
        self.open.pop().__exit__(None, None, None)

    def close(self) -> None:
        while self.open:
            self.open.pop().__exit__(None, None, None)


# ---- the trace -> lanes ---------------------------------------------------------------------------------
def _short(name: str) -> str:
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 3] + "..."


def cpu_class(name: str) -> str:
    """The class of a CPU operator, by its name: ``gather``, ``copy`` or ``compute``."""
    low = name.lower()
    if any(w in low for w in GATHER_WORDS):
        return "gather"
    if any(w in low for w in COPY_WORDS):
        return "copy"
    return "compute"


def _outermost(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of one thread that no other event of the list contains (operators nest)."""
    out: list[dict[str, Any]] = []
    end = -float("inf")
    for ev in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if ev["ts"] >= end:
            out.append(ev)
            end = ev["ts"] + ev.get("dur", 0)
    return out


class ProfileWithoutGpu(WshardingError, RuntimeError):
    """A CUDA rank's profile recorded no kernel: the profiler could not see the GPU."""


def _step_window(events: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(STEP_LABEL)
             and e.get("cat") in ("user_annotation", "cpu_op", "python_function")]
    if not steps:
        raise InvalidArgument(f"no {STEP_LABEL!r} range in the trace: was the step labelled under the profiler?")
    return max(steps, key=lambda e: e["ts"])


def lanes_from_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """The last labelled step of a Chrome trace (``prof.export_chrome_trace``) as lanes of intervals.

    Returns ``{"step_us", "kind", "names", "lanes"}``: ``kind`` is ``"streams"`` when the trace holds
    device activity, else ``"threads"``; ``names`` the distinct interval names; each lane
    ``{"lane", "role", "intervals"}`` with interval rows as :data:`COLUMNS` (``name`` an index into
    ``names``), times in microseconds from the step's start, clipped to the step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    step = _step_window(events)
    t0, t1 = float(step["ts"]), float(step["ts"]) + float(step.get("dur", 0))
    main_tid = step.get("tid")
    inside = [e for e in events if t0 <= float(e["ts"]) < t1 and e is not step]
    names: list[str] = []
    index: dict[str, int] = {}

    def row(ev: dict[str, Any], cls: str) -> list[Any]:
        name = _short(str(ev.get("name", "")))
        if name not in index:
            index[name] = len(names)
            names.append(name)
        start = float(ev["ts"]) - t0
        end = min(float(ev["ts"]) + float(ev.get("dur", 0)), t1) - t0
        return [round(start, 2), round(end, 2), cls, index[name]]

    lanes: list[dict[str, Any]] = []
    host = [e for e in inside if e.get("cat") == "user_annotation" and e.get("tid") == main_tid]
    layers = [e for e in host if str(e["name"]).startswith(LAYER_LABEL + " ")]
    calls = [e for e in host if str(e["name"]).startswith(PLANNER_LABEL)]
    device = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if layers:
        lanes.append({"lane": "host: layers", "role": "host", "intervals": [row(e, "layer") for e in layers]})
    if calls:
        lanes.append({"lane": "host: planner calls", "role": "host",
                      "intervals": [row(e, "planner") for e in _outermost(calls)]})
    if device:
        by_stream: dict[Any, list[dict[str, Any]]] = {}
        for e in device:
            by_stream.setdefault(e.get("args", {}).get("stream", e.get("tid")), []).append(e)

        def compute_us(evs: list[dict[str, Any]]) -> float:
            return sum(float(e.get("dur", 0)) for e in evs if e["cat"] == "kernel" and "nccl" not in e["name"].lower())

        compute_stream = max(by_stream, key=lambda s: compute_us(by_stream[s]))
        for stream in sorted(by_stream, key=lambda s: (s != compute_stream, str(s))):
            evs = sorted(by_stream[stream], key=lambda e: e["ts"])
            rows = []
            for e in evs:
                if e["cat"] == "kernel" and "nccl" in e["name"].lower():
                    cls = "gather"
                elif e["cat"] == "kernel":
                    cls = "compute" if stream == compute_stream else "copy"
                elif e["cat"] == "gpu_memcpy":
                    cls = "copy" if stream == compute_stream else "gather"
                else:
                    cls = "copy"
                rows.append(row(e, cls))
            role = "compute" if stream == compute_stream else ("gather" if any(r[2] == "gather" for r in rows) else "other")
            lanes.append({"lane": f"stream {stream} ({role})", "role": role, "intervals": rows})
        kind = "streams"
    else:
        ops = [e for e in inside if e.get("cat") == "cpu_op"]
        by_tid: dict[Any, list[dict[str, Any]]] = {}
        for e in ops:
            by_tid.setdefault(e.get("tid"), []).append(e)
        others = sorted((t for t in by_tid if t != main_tid), key=str)
        if main_tid in by_tid:
            lanes.append({"lane": "thread: model", "role": "compute",
                          "intervals": [row(e, cpu_class(str(e["name"]))) for e in _outermost(by_tid[main_tid])]})
        for k, tid in enumerate(others, 1):
            # the rank process starts no threads of its own that run operators: these are gloo's
            # workers, running the gathers issued from the model's thread (their copies in and out)
            lanes.append({"lane": f"thread {k}: gloo worker", "role": "gather",
                          "intervals": [row(e, "gather") for e in _outermost(by_tid[tid])]})
        kind = "threads"
    return {"step_us": round(t1 - t0, 2), "kind": kind, "names": names, "lanes": lanes}


# ---- the rank task ----------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_rank(ctx: RankContext, preset: str, *, tokens: int = 8, steps: int = 3, warmup: int = 2,
                 comm: str = "auto") -> dict[str, Any]:
    """On one rank: the sharded decoder (layers 1..L-1 sharded, as the design) for ``warmup``
    unprofiled steps, then ``steps`` profiled ones; the last as lanes (:func:`lanes_from_trace`)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from wsharding.core.sharding import WeightSharding
    from wsharding.models.decoder import process_weights

    # Kineto prints its stages ("USDT: ... profiler_start") on stderr at every profile, which a notebook
    # shows as error output; 6 is above its highest level. Kept when the caller set a level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    c = shard_comm_for(ctx, comm)
    dev = c.device
    cfg = decoder_config(preset)
    ws = WeightSharding(c, sharded_layers=range(1, cfg.layers))
    model = ToyDecoder(cfg, seed=0, weight_sharding=ws, device=dev).eval()
    process_weights(model)
    ws.finalize()
    x = torch.randint(0, cfg.vocab, (tokens,), generator=torch.Generator().manual_seed(ctx.rank)).to(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.no_grad(), labelled(model):
        for _ in range(warmup):
            model(x)
        _sync(dev)
        with profile(activities=activities) as prof:
            for s in range(steps):
                with record_function(f"{STEP_LABEL} {s}"):
                    model(x)
                    _sync(dev)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="wsharding_profile_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    lanes = lanes_from_trace(trace)
    if dev.type == "cuda" and lanes["kind"] != "streams":
        raise ProfileWithoutGpu(f"rank {ctx.rank}: the profile holds no GPU activity (CUPTI unavailable to torch.profiler "
                                "in this process?); set KINETO_LOG_LEVEL=0 to see the profiler's own messages")
    sharded_layers = len(ws.sharded_layer_ids)
    ws.close()  # collective on our NCCL backend: every rank reaches it
    # ranks sharing a GPU meet over gloo (a CPU context), but the gathers run on the GPU: the
    # communicator says what is emulated
    emulation = c.emulation if dev.type == "cuda" else ctx.emulation
    return {"rank": ctx.rank, "mode": c.mode, "emulation": emulation,
            "communicator": type(c).__name__, "sharded_layers": sharded_layers, **lanes}


# ---- the report -------------------------------------------------------------------------------------------
def summarize(results: list[dict[str, Any]], preset: str, tokens: int, steps: int) -> dict[str, Any]:
    """The benchmark's report: the run's words (mode, emulation, machine, date) and each rank's lanes."""
    r0 = results[0]
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"bench": "profile", "preset": preset, "tokens": tokens, "profiled_steps": steps,
            "world_size": len(results), "mode": r0["mode"], "emulation": r0["emulation"],
            "communicator": r0["communicator"], "sharded_layers": r0["sharded_layers"],
            "kind": r0["kind"], "columns": list(COLUMNS), "classes": list(CLASSES),
            "date": time.strftime("%Y-%m-%d"), "device_name": device, "torch": torch.__version__,
            "ranks": [{k: r[k] for k in ("rank", "step_us", "names", "lanes")} for r in results]}


def format_table(report: dict[str, Any]) -> str:
    """Per rank and lane: intervals, busy time by class."""
    lines = [f"wsharding bench profile -- {report['mode']}, {report['world_size']} ranks, {report['preset']}, "
             f"{report['tokens']} tokens/rank, {report['device_name']}, lanes are {report['kind']}"]
    if report["emulation"]:
        lines.append(f"  NOTE: {report['emulation']}")
        if report["kind"] == "threads":
            lines.append("  emulation: CPU processes, lanes are threads, not streams")
    for r in report["ranks"]:
        lines.append(f"  rank {r['rank']}: step {r['step_us'] / 1e3:.3f} ms")
        for lane in r["lanes"]:
            busy: dict[str, float] = {}
            for start, end, cls, _ in lane["intervals"]:
                busy[cls] = busy.get(cls, 0.0) + end - start
            parts = ", ".join(f"{cls} {us / 1e3:.3f} ms" for cls, us in sorted(busy.items()))
            lines.append(f"    {lane['lane']:<28}{len(lane['intervals']):>5} intervals  {parts}")
    return "\n".join(lines)


def _figure(report: dict[str, Any]) -> Any:
    from wsharding.lab.viz.profile import stream_timeline_figure  # plotly: absent on the GPU machine

    return stream_timeline_figure(report)


def run_profile(ranks: int | None = None, preset: str | None = None, *, tokens: int = 8, steps: int = 3,
                comm: str = "auto") -> dict[str, Any]:
    """Start the ranks (all GPUs, or 2 CPU ranks by default), profile, and return the report."""
    gpus = gpu_count()
    n = ranks or (gpus if gpus else 2)
    preset = preset or ("k3-like" if gpus and not in_ci() else "tiny")
    with bench_cluster(n) as cluster:
        results = cluster.run(profile_rank, preset, tokens=tokens, steps=steps, comm=auto_comm(comm))
    return summarize(results, preset, tokens, steps)


def newest_saved(folder: str | Path, pattern: str = "profile_*.json") -> dict[str, Any] | None:
    """The newest (by date, then file name) ``bench profile`` report kept under ``folder`` and its
    per-machine-and-day folders, or None when there is none."""
    found = []
    for path in Path(folder).rglob(pattern):
        report = read_saved_report(path)
        if report.get("bench") == "profile":
            found.append((report.get("date", ""), path.name, report))
    return max(found, key=lambda f: (f[0], f[1]))[2] if found else None


def main(args: argparse.Namespace) -> int:
    check_output_path(str(json_path(args.json)) if args.json else "", "--json")
    report = run_profile(args.ranks, args.preset, tokens=args.tokens, steps=args.steps, comm=args.comm)
    print(format_table(report))
    if args.json:
        save_report(report, args.json, _figure)
    return 0
