"""``wsharding bench step``: step time of one model replicated, weight-sharded (lookahead on and off)
and under FSDP2 (``fully_shard``, the usual way to shard weights, here used for inference), across
tokens per rank, measured side by side in one run on the same ranks -- with the link floor of the
same run and the host time the planner costs per layer.

Two models: ``--model llama8b-blocks`` (the FSDP2 baseline's model, sharded from the outside with
``shard_blocks``) and ``--model k3-like`` (the ToyDecoder, whose layers call the planner themselves);
their small versions ``tiny-blocks`` and ``tiny`` run on CPU ranks. ``--graph`` also captures each
model's whole layer loop in a CUDA graph at decode sizes and replays it.

What to read:

* ``sharded / replicated`` -- the price of storing 1/N of the weights;
* ``sharded / floor`` -- the link floor is the sum over layers of (N-1)/N * S_l / B, with B the bus
  bandwidth of this comm measured in this run: at decode sizes no schedule beats it;
* ``no lookahead`` against ``sharded`` -- what the lookahead hides;
* host us per layer -- the planner and communicator alone (a bare layer loop without compute), and
  the sharded forward's host time minus the replicated one's, per sharded layer.

Absolute times on CPU ranks are emulated, and every row says so; there each measurement is repeated
and printed as median (min-max), so that noise is seen as noise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from wsharding.comm_by_name import graph_unsupported, shard_comm_for
from wsharding.core.comm import Communicator
from wsharding.core.context import RankContext
from wsharding.core.errors import NotFound
from wsharding.core.next_step import NextStepPrefetch
from wsharding.core.runner import shard_blocks
from wsharding.core.sharding import WeightSharding
from wsharding.core.units import ceil_div
from wsharding.cuda_graph import capture_graph
from wsharding.io_checks import read_saved_report
from wsharding.lab.args.bench_step import MODELS as MODELS
from wsharding.lab.args.bench_step import add_arguments as add_arguments
from wsharding.lab.bench.paired import PairedDifference, lookahead_vs_off, variants_paired
from wsharding.lab.bench.planner_calls import planner_calls_us_per_layer
from wsharding.lab.bench.report import json_path, save_report
from wsharding.lab.bench.rounds import round_orders
from wsharding.lab.cliargs import check_output_path
from wsharding.lab.cluster import RankCluster
from wsharding.models import build_pair, decoder_config
from wsharding.models.blocks import BLOCK_PRESETS, BLOCK_TARGETS, build_blocks
from wsharding.runtime import gpu_count, in_ci

EAGER = ("replicated", "sharded", "sharded_no_lookahead", "sharded_next_step", "sharded_issue_thread",
         "sharded_mapped", "sharded_mapped_next_step", "sharded_mapped_issue_thread", "fsdp2")
#: What the variants that are not self-explanatory measure (printed under the table).
LEGEND = {"sharded_next_step": "sharded, with the next step's first gather issued while this step's last layers run "
                               "(NextStepPrefetch)",
          "sharded_mapped": "a second sharding of the model whose layers gather into views mapped over their chunks: "
                            "no own-chunk copy (map_own_chunk=True, NCCL >= 2.30)",
          "sharded_mapped_next_step": "sharded_mapped, with the next step's first gather issued while this step's last "
                                      "layers run: both ways of taking a gather off the step's critical path",
          "sharded_issue_thread": "sharded, the gathers issued by the communicator's native issue thread: the model's "
                                  "thread only hands them over (NcclCommunicator.set_issue_thread)",
          "sharded_mapped_issue_thread": "sharded_mapped, with the issue thread"}
#: The variants that run with the communicator's issue thread on.
ISSUE_THREAD = ("sharded_issue_thread", "sharded_mapped_issue_thread")
GRAPH = ("graph_replicated", "graph_sharded", "graph_sharded_mapped")
#: Largest tokens per rank that --graph captures (decode sizes).
GRAPH_MAX_TOKENS = 256
#: Paired calls behind the host overhead per layer at decode sizes on GPUs (paired_host_us).
HOST_PAIRS = 200


#: The variants whose planner calls are timed inside their forwards, and the row key of each.
PLANNER_CALLS = {"sharded": "planner_calls_us_per_layer", "sharded_mapped": "planner_calls_mapped_us_per_layer",
                 "sharded_issue_thread": "planner_calls_issue_thread_us_per_layer",
                 "sharded_mapped_issue_thread": "planner_calls_mapped_issue_thread_us_per_layer"}


# ---- the models ---------------------------------------------------------------------------------------
def sharded_twin(model: str, comm: Communicator, **options: Any) -> tuple[torch.nn.Module, WeightSharding]:
    """``model`` built on this rank and sharded over ``comm`` (``options``: WeightSharding's)."""
    if model in BLOCK_PRESETS:
        sharded = build_blocks(model, comm.device)
        return sharded, shard_blocks(sharded, "layers", BLOCK_TARGETS, comm, **options)
    sharded = build_pair(decoder_config(model), comm, **options)[1]
    return sharded, sharded.weight_sharding


def _models(ctx: RankContext, model: str, comm: Communicator, fsdp: bool):
    """(replicated, sharded, WeightSharding, make_input, fsdp2 or None) for ``model`` on this rank."""
    dev = comm.device
    if model in BLOCK_PRESETS:
        replicated = build_blocks(model, dev)
        sharded, ws = sharded_twin(model, comm, map_own_chunk=False)  # plain: --mapped adds the mapped twin

        def make_input(tokens: int, seed: int) -> torch.Tensor:
            return replicated.inputs(tokens, seed, dev)

        build = lambda: build_blocks(model, dev)  # noqa: E731
    else:
        cfg = decoder_config(model)
        replicated, sharded = build_pair(cfg, comm, map_own_chunk=False)
        ws = sharded.weight_sharding

        def make_input(tokens: int, seed: int) -> torch.Tensor:
            return torch.randint(0, cfg.vocab, (tokens,), generator=torch.Generator().manual_seed(seed)).to(dev)

        from wsharding.models import ToyDecoder

        build = lambda: ToyDecoder(cfg, seed=0, device=dev).eval()  # noqa: E731
    fsdp_model = _fsdp2(build(), ctx, dev) if fsdp else None
    return replicated, sharded, ws, make_input, fsdp_model


def _fsdp2(model: torch.nn.Module, ctx: RankContext, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (ctx.world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    return model


# ---- timing ---------------------------------------------------------------------------------------------
def timed_steps(fn: Callable[[], Any], steps: int, device: torch.device) -> tuple[float, float]:
    """(device ms per call, host ms per call). On GPU the device time comes from CUDA events over
    ``steps`` calls back to back, and the host time from a second loop in which the GPU is drained
    before each call (outside the timing): back to back, a host that runs ahead ends up waiting for
    the GPU (CUDA's launch queue, the planner's backpressure), and its time would measure the GPU.
    On CPU both are wall time."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        host = 0.0
        for _ in range(steps):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            host += time.perf_counter() - t0
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / steps, host / steps * 1e3
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    ms = (time.perf_counter() - t0) / steps * 1e3
    return ms, ms


def paired_host_us(base: Callable[[], Any], other: Callable[[], Any], layers: int, pairs: int,
                   device: torch.device) -> tuple[float, float, float]:
    """Host microseconds per layer that ``other`` costs over ``base``: (median, lower and upper quartile).

    The host time of one forward drifts by up to 2x between calls on a shared machine (clocks, other
    tenants), far more than the planner's few microseconds per layer; two separate medians subtracted
    measure mostly that drift. So the two are timed in pairs, one call each, back to back (which one
    goes first alternates), the GPU drained before each call outside the timing, and the per-pair
    differences give the median. On CPU ranks the host time is the step's wall time."""
    cuda = device.type == "cuda"
    diffs = []
    for k in range(pairs):
        took = {}
        for name, fn in ((("base", base), ("other", other)) if k % 2 == 0 else (("other", other), ("base", base))):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            took[name] = time.perf_counter() - t0
        diffs.append((took["other"] - took["base"]) * 1e6 / layers)
    if cuda:
        torch.cuda.synchronize(device)
    q1, median, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else (diffs[0],) * 3
    return median, q1, q3


def _call(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    return lambda: model(x)


def bus_bandwidth(ws: WeightSharding, comm: Communicator, iters: int = 10) -> float:
    """Bytes per second of this comm's in-place gather of the largest layer: (N-1)/N * S / t (the
    NCCL tests' bus bandwidth). 0 at world size 1 (no link)."""
    n = comm.world_size
    if n == 1:
        return 0.0
    layer = max(ws.sharded_layer_ids, key=lambda i: ws.layouts[i].total_bytes)
    size = ws.layouts[layer].total_bytes
    full = ws.slots.full_buffer(layer)  # the layer's own slot range (a mapped pool has no whole slot)
    own = full.narrow(0, comm.rank * (size // n), size // n)
    g = comm.prepare_gather(full, own, what=f"bus bandwidth probe ({size} B)")
    dev = comm.device

    def once() -> None:
        g.start()
        g.wait(torch.cuda.current_stream(dev) if dev.type == "cuda" else None)

    try:
        for _ in range(3):
            once()
        ms, _ = timed_steps(once, iters, dev)
    finally:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if hasattr(g, "close"):
            g.close()
    return (n - 1) / n * size / (ms * 1e-3)


def link_floor(ws: WeightSharding, comm: Communicator) -> tuple[float, float]:
    """(bus bandwidth B/s measured now, link floor ms): the floor is the sum over sharded layers of
    (N-1)/N * S_l / B, the least time a step can take when every layer's gather must cross the link."""
    bw = bus_bandwidth(ws, comm)
    n = comm.world_size
    return bw, (sum((n - 1) / n * ws.layouts[i].total_bytes / bw for i in ws.sharded_layer_ids) * 1e3 if bw else 0.0)


def planner_host_us(ws: WeightSharding, iters: int = 20) -> float:
    """Host microseconds per sharded layer of the planner and communicator alone: the step's launch
    and wait sequence without any layer compute (each step's host time measured, then synchronised,
    so a full launch queue never counts)."""
    planner = ws.planner
    end = max(ws.sharded_layer_ids) + 1
    cuda = planner.device.type == "cuda"
    total = 0.0
    for k in range(iters + 2):  # the first two are warm-up: not counted
        t0 = time.perf_counter()
        planner.begin_step(0, end)
        for i in range(end):
            planner.block_start(i)
            planner.block_end(i)
        planner.end_step()
        dt = time.perf_counter() - t0
        if cuda:
            torch.cuda.synchronize(planner.device)
        if k >= 2:
            total += dt
    return total / iters / len(ws.sharded_layer_ids) * 1e6


def check_cost_us(ws: Any, calls: int = 20000) -> dict[str, float]:
    """Host microseconds: per call of the check at use (``ensure`` of a held layer), and per layer of the
    planner's whole step with no compute between (:func:`~wsharding.lab.bench.step.planner_host_us`:
    the check, the issues and the joins)."""
    p = ws.planner
    layer = p.sharded_ids[-1]
    p.lend_slots()
    p.filled(layer)  # its slot holds it: the O(1) path
    clock = time.perf_counter
    samples = []
    for _ in range(5):
        t0 = clock()
        for _ in range(calls):
            p.ensure(layer)
        samples.append((clock() - t0) / calls * 1e6)
    ensure_us = statistics.median(samples)
    p.lend_slots()  # forget the pretend fill: the slot never received that layer's bytes
    return {"ensure_us": ensure_us, "planner_us_per_layer": planner_host_us(ws)}


def direct_launch_host_us(ws: WeightSharding) -> float | None:
    """:func:`planner_host_us` with every gather calling ``ncclAllGather`` itself instead of launching
    its captured graph ([Note: a gather launched as a graph]); None when no gather has a graph."""
    gathers = [g for g in ws.planner.gathers.values() if getattr(g, "launch", None) == "graph"]
    if not gathers:
        return None
    for g in gathers:
        g.launch = "direct"
    try:
        return planner_host_us(ws)
    finally:
        for g in gathers:
            g.launch = "graph"


# ---- one rank ---------------------------------------------------------------------------------------------
def step_bench_rank(ctx: RankContext, model: str, tokens: list[int], *, steps: int = 10, warmup: int = 3,
                    comm: str = "auto", fsdp: bool = True, graph: bool = False, repeats: int = 1,
                    mapped: bool = False, issue_thread: bool = False) -> dict[str, Any]:
    """On one rank: every variant at every tokens-per-rank value, in the same run. ``mapped``: also
    the ``sharded_mapped`` and ``sharded_mapped_next_step`` variants (a second sharding with
    ``map_own_chunk=True``, without and with the next-step prefetch). ``issue_thread``: also the
    ``*_issue_thread`` variants (our NCCL communicator only)."""
    c = shard_comm_for(ctx, comm)
    dev = c.device
    # FSDP2 runs on torch.distributed's own devices: not when ranks share a GPU over a gloo group.
    fsdp = fsdp and ctx.device.type == dev.type
    graph_error = graph_unsupported(c) if graph else None
    graph = graph and graph_error is None
    replicated, sharded, ws, make_input, fsdp_model = _models(ctx, model, c, fsdp)
    sharded_mapped, ws_mapped = sharded_twin(model, c, map_own_chunk=True) if mapped else (None, None)
    planner = ws.planner
    bw, floor_ms = link_floor(ws, c)
    planner_us = planner_host_us(ws)
    check_us = check_cost_us(ws)["ensure_us"]
    planner_us_direct = direct_launch_host_us(ws)
    planner_us_mapped = planner_host_us(ws_mapped) if ws_mapped is not None else None
    issue_thread = issue_thread and c.offers_issue_thread
    planner_us_issue_thread = None
    if issue_thread:
        c.set_issue_thread(True)
        planner_us_issue_thread = planner_host_us(ws)
        c.set_issue_thread(False)
    rows = []

    def switch(variant: str) -> None:
        planner.lookahead = variant != "sharded_no_lookahead"
        NextStepPrefetch.switch(planner, variant == "sharded_next_step")
        if ws_mapped is not None:
            NextStepPrefetch.switch(ws_mapped.planner, variant == "sharded_mapped_next_step")
        if issue_thread:
            c.set_issue_thread(variant in ISSUE_THREAD)

    def measure(row: dict[str, Any], runs: dict[str, Callable[[], Any]]) -> None:
        # Every variant warmed up, then the repeats in rounds of rotating order (wsharding.lab.bench.rounds).
        names = list(runs)
        for variant in names:
            switch(variant)
            for _ in range(warmup):
                runs[variant]()
        samples: dict[str, list[float]] = {v: [] for v in names}
        hosts: dict[str, list[float]] = {v: [] for v in names}
        for order in round_orders(names, repeats):
            for variant in order:
                switch(variant)
                c.barrier()
                ms, host = timed_steps(runs[variant], steps, dev)
                samples[variant].append(ms)
                hosts[variant].append(host)
        for variant in names:
            row[variant] = samples[variant]
            row[f"{variant}_host_ms"] = statistics.median(hosts[variant])
        # what the sharded forward adds to the host per sharded layer: hooks, planner, communicator
        layers = len(ws.sharded_layer_ids)
        # the same count on every rank (the sharded forward is collective); at decode sizes, where the
        # host time matters, enough pairs that the median settles (the quartiles span ~20 us per layer)
        pairs = HOST_PAIRS if dev.type == "cuda" and row["tokens_per_rank"] <= GRAPH_MAX_TOKENS else max(steps * repeats, 8)
        for variant, key in (("sharded", "host_overhead"), ("sharded_mapped", "host_overhead_mapped"),
                             ("sharded_issue_thread", "host_overhead_issue_thread"),
                             ("sharded_mapped_issue_thread", "host_overhead_mapped_issue_thread")):
            if "replicated" in runs and variant in runs:
                switch(variant)
                c.barrier()
                row[f"{key}_us_per_layer"] = paired_host_us(runs["replicated"], runs[variant], layers, pairs, dev)
        # what of it is the planner's and the communicator's own calls, timed inside real forwards: back
        # to back as a decode loop runs them (the waits for the GPU apart), and on a drained GPU
        # ([Note: steady forwards, the GPU wait taken out] in planner_calls.py)
        drain = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
        for variant, key in PLANNER_CALLS.items():
            if variant in runs:
                switch(variant)
                c.barrier()
                planner = (ws_mapped if "mapped" in variant else ws).planner
                row[key], row[f"{key}_by_call"], row[f"{key}_gpu_wait"] = planner_calls_us_per_layer(
                    planner, runs[variant], steps, layers)
                if drain is not None:
                    c.barrier()
                    row[f"{key}_drained"] = planner_calls_us_per_layer(planner, runs[variant], steps, layers, drain)[0]
        switch("sharded")  # no prefetch_next_step: a CUDA graph captured later must find nothing pending

    with torch.no_grad():
        for t in tokens:
            x = make_input(t, 1000 + ctx.rank)
            row: dict[str, Any] = {"tokens_per_rank": t, "equal": bool(torch.equal(replicated(x), sharded(x)))}
            runs = {"replicated": _call(replicated, x), "sharded": _call(sharded, x),
                    "sharded_no_lookahead": _call(sharded, x), "sharded_next_step": _call(sharded, x)}
            if issue_thread:
                runs["sharded_issue_thread"] = _call(sharded, x)
            if sharded_mapped is not None:
                row["equal"] = row["equal"] and bool(torch.equal(replicated(x), sharded_mapped(x)))
                runs["sharded_mapped"] = runs["sharded_mapped_next_step"] = _call(sharded_mapped, x)
                if issue_thread:
                    runs["sharded_mapped_issue_thread"] = _call(sharded_mapped, x)
            if fsdp_model is not None:
                runs["fsdp2"] = _call(fsdp_model, x)
            measure(row, runs)
            # The prefetching variants checked as they ran: a step that takes the gather its previous
            # step issued must compute what the replicated model does.
            for variant in ("sharded_next_step", "sharded_mapped_next_step", *ISSUE_THREAD):
                if variant in runs:
                    switch(variant)
                    outs = [runs[variant]() for _ in range(2)]
                    switch("sharded")
                    row["equal"] = row["equal"] and all(bool(torch.equal(replicated(x), o)) for o in outs)
            rows.append(row)
        # CUDA graphs last, at decode sizes: a capture that fails can only cost the graph numbers.
        for row in rows if graph else []:
            if row["tokens_per_rank"] > GRAPH_MAX_TOKENS:
                continue
            x = make_input(row["tokens_per_rank"], 1000 + ctx.rank)
            try:
                runs = {"graph_replicated": capture_graph(_call(replicated, x), dev)[0].replay,
                        "graph_sharded": capture_graph(_call(sharded, x), dev)[0].replay}
                if sharded_mapped is not None:
                    runs["graph_sharded_mapped"] = capture_graph(_call(sharded_mapped, x), dev)[0].replay
            except RuntimeError as e:
                graph_error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                break
            measure(row, runs)
    # ranks sharing a GPU meet over gloo (a CPU context), but the gathers run on the GPU: the
    # communicator says what is emulated
    return {"rank": ctx.rank, "mode": c.mode, "emulation": c.emulation if dev.type == "cuda" else ctx.emulation,
            "rows": rows, "bus_bandwidth_Bps": bw, "floor_ms": floor_ms, "planner_host_us_per_layer": planner_us,
            "check_at_use_us": check_us,
            "planner_host_us_per_layer_direct": planner_us_direct,
            "planner_host_us_per_layer_mapped": planner_us_mapped,
            "planner_host_us_per_layer_issue_thread": planner_us_issue_thread,
            "gather_launch": c.gather_launch,
            "nccl_blocking": c.blocking,
            "sharded_layers": len(ws.sharded_layer_ids), "layer_bytes": [ws.layouts[i].total_bytes for i in ws.sharded_layer_ids],
            "replicated_bytes": ws.replicated_bytes(), "sharded_resident_bytes": ws.resident_bytes(),
            "mapped_resident_bytes": ws_mapped.resident_bytes() if ws_mapped is not None else None,
            "fsdp2": fsdp_model is not None,
            "nccl_in_progress_launches": sum(getattr(g, "in_progress_launches", 0) for g in planner.gathers.values()), "graph_error": graph_error}


# ---- the report -------------------------------------------------------------------------------------------
def summarize(results: list[dict[str, Any]], model: str, comm: str) -> dict[str, Any]:
    """Per tokens value and variant: the slowest rank's median (a step ends when every rank ends),
    with the spread over repeats, ratios, the floor and the host costs."""
    r0 = results[0]
    variants = [v for v in EAGER + GRAPH if any(v in row for row in r0["rows"])]
    layers = r0["sharded_layers"]
    rows = []
    for i, row in enumerate(r0["rows"]):
        merged: dict[str, Any] = {"tokens_per_rank": row["tokens_per_rank"],
                                  "equal": all(r["rows"][i]["equal"] for r in results)}
        for v in [v for v in variants if v in row]:
            per_rank = [r["rows"][i][v] for r in results]
            worst = max(per_rank, key=statistics.median)
            merged[v] = statistics.median(worst)
            merged[f"{v}_min"], merged[f"{v}_max"] = min(worst), max(worst)
            merged[f"{v}_host_ms"] = max(r["rows"][i][f"{v}_host_ms"] for r in results)
        for v in [v for v in variants if v in row]:
            if v != "replicated" and v != "graph_replicated":
                base = "graph_replicated" if v.startswith("graph") else "replicated"
                merged[f"{v}_vs_replicated"] = merged[v] / merged[base]
        floor = max(r["floor_ms"] for r in results)
        merged["floor_ms"] = floor
        if floor:
            merged["sharded_vs_floor"] = merged["sharded"] / floor
        if "sharded" in row and "sharded_no_lookahead" in row:
            merged["lookahead_vs_off"] = lookahead_vs_off([r["rows"][i] for r in results]).as_dict()
        if "sharded" in row and "sharded_issue_thread" in row:
            merged["issue_thread_vs_inline"] = variants_paired(
                [r["rows"][i] for r in results], "sharded_issue_thread", "sharded",
                ("issue thread", "issued inline")).as_dict()
        for key in PLANNER_CALLS.values():
            if key in row:  # the slowest rank's, with its split by call
                slowest = max(results, key=lambda r: r["rows"][i][key])["rows"][i]
                merged.update({k: slowest[k] for k in (key, f"{key}_by_call", f"{key}_gpu_wait", f"{key}_drained")
                               if k in slowest})
        for key in ("host_overhead_us_per_layer", "host_overhead_mapped_us_per_layer",
                    "host_overhead_issue_thread_us_per_layer", "host_overhead_mapped_issue_thread_us_per_layer"):
            if key in row:  # the slowest rank's (median, q1, q3) of paired differences (paired_host_us)
                merged[key], merged[f"{key}_q1"], merged[f"{key}_q3"] = max((r["rows"][i][key] for r in results),
                                                                            key=lambda m: m[0])
        rows.append(merged)
    return {"bench": "step", "model": model, "comm": comm, "mode": r0["mode"], "emulation": r0["emulation"],
            "world_size": len(results), "variants": variants, "sharded_layers": layers,
            "graph_error": next((r["graph_error"] for r in results if r.get("graph_error")), None),
            "bus_bandwidth_GBps": min(r["bus_bandwidth_Bps"] for r in results) / 1e9,
            "planner_host_us_per_layer": max(r["planner_host_us_per_layer"] for r in results),
            "check_at_use_us": max(r["check_at_use_us"] for r in results),
            "planner_host_us_per_layer_direct": (max(r["planner_host_us_per_layer_direct"] for r in results)
                                                 if results[0].get("planner_host_us_per_layer_direct") else None),
            "planner_host_us_per_layer_mapped": (max(r["planner_host_us_per_layer_mapped"] for r in results)
                                                 if results[0].get("planner_host_us_per_layer_mapped") else None),
            "planner_host_us_per_layer_issue_thread": (
                max(r["planner_host_us_per_layer_issue_thread"] for r in results)
                if results[0].get("planner_host_us_per_layer_issue_thread") else None),
            "gather_launch": results[0].get("gather_launch"),
            "nccl_blocking": results[0].get("nccl_blocking"),
            "replicated_bytes_per_rank": r0["replicated_bytes"],
            "sharded_resident_bytes_per_rank": r0["sharded_resident_bytes"],
            "mapped_resident_bytes_per_rank": r0.get("mapped_resident_bytes"), "rows": rows,
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def format_table(report: dict[str, Any]) -> str:
    head = (f"wsharding bench step -- {report['mode']}, {report['world_size']} ranks, model {report['model']}, "
            f"comm {report['comm']}")
    lines = [head] + ([f"  NOTE: {report['emulation']}"] if report["emulation"] else [])
    bandwidth = (f"bus bandwidth {report['bus_bandwidth_GBps']:.1f} GB/s" if report["world_size"] > 1
                 else "no bus bandwidth at world size 1 (nothing crosses a link)")
    lines.append(f"  {bandwidth}; planner + comm host time "
                 f"{report['planner_host_us_per_layer']:.1f} us per sharded layer (bare loop, no compute"
                 + (f"; gathers launched as graphs, {report['planner_host_us_per_layer_direct']:.1f} us with "
                    "ncclAllGather called per layer" if report.get("planner_host_us_per_layer_direct") else "")
                 + (f"; {report['planner_host_us_per_layer_mapped']:.1f} us with map_own_chunk"
                    if report.get("planner_host_us_per_layer_mapped") else "")
                 + (f"; {report['planner_host_us_per_layer_issue_thread']:.1f} us with the issue thread, waits for "
                    "it included" if report.get("planner_host_us_per_layer_issue_thread") else "")
                 + ")")
    if report.get("check_at_use_us") is not None:  # saved reports from before the check have none
        lines.append(f"  the check at use (a block's slot holds its own layer, gathered in this step): "
                     f"{report['check_at_use_us']:.3f} us on the host per block, the slowest rank's median")
    lines.append(f"  sharded weights per rank: {report['replicated_bytes_per_rank'] / 2**20:.1f} MiB replicated, "
                 f"{report['sharded_resident_bytes_per_rank'] / 2**20:.1f} MiB sharded (R/N + 2 max|T|)"
                 + (f", {report['mapped_resident_bytes_per_rank'] / 2**20:.1f} MiB with map_own_chunk "
                    "(R/N + 2 (N-1)/N max|T|, chunks padded to whole pages)"
                    if report.get("mapped_resident_bytes_per_rank") else ""))
    cols = report["variants"]
    spread = any(row[f"{c}_max"] > row[f"{c}_min"] for row in report["rows"] for c in cols if c in row) and not any(
        c.startswith("graph") for c in cols) and report["mode"].startswith("cpu")
    w = max(24, max(len(c) for c in cols) + 2)  # a column as wide as its longest name
    lines.append("  tokens/rank " + "".join(f"{c:>{w}}" for c in cols) + f"{'floor':>11}{'host +us/layer':>22}  equal")
    for row in report["rows"]:
        cells = []
        for c in cols:
            if c not in row:
                cells.append("-")
                continue
            cell = f"{row[c]:8.3f} ms"
            if spread:
                cell = f"{row[c]:7.2f} ({row[c + '_min']:.2f}-{row[c + '_max']:.2f})"
            if f"{c}_vs_replicated" in row:
                cell += f" {row[c + '_vs_replicated']:4.2f}x"
            cells.append(cell)
        floor = f"{row['floor_ms']:7.3f} ms" if row["floor_ms"] else "   (N=1)  "
        lines.append(f"  {row['tokens_per_rank']:>11} " + "".join(f"{c:>{w}}" for c in cells)
                     + f"{floor:>11}  {_host_cell(row, 'host_overhead_us_per_layer'):>24}  {row['equal']}")
    lines += [f"  {c}: {LEGEND[c]}" for c in cols if c in LEGEND]
    lines += [f"  {row['tokens_per_rank']} tokens/rank, {PairedDifference(**row[key]).line()}"
              for key in ("lookahead_vs_off", "issue_thread_vs_inline") for row in report["rows"] if key in row]
    first = report["rows"][0] if report["rows"] else {}
    if "host_overhead_us_per_layer_q1" in first:
        layers = report["sharded_layers"]
        lines.append("  host +us/layer: what the sharded forward adds to the host per sharded layer (hooks, planner, "
                     "communicator) over the replicated forward, median (quartiles) of paired calls; the replicated "
                     f"forward itself takes {first['replicated_host_ms'] * 1e3 / layers:.0f} us of host per layer"
                     + ("; on CPU ranks host time is the step's wall time, waits for the gathers included"
                        if report["mode"].startswith("cpu") else "")
                     + "".join(f"; {label}: " + ", ".join(_host_cell(row, key) for row in report["rows"])
                               for label, key in (("with map_own_chunk", "host_overhead_mapped_us_per_layer"),
                                                  ("with the issue thread", "host_overhead_issue_thread_us_per_layer"),
                                                  ("with map_own_chunk and the issue thread",
                                                   "host_overhead_mapped_issue_thread_us_per_layer"))
                               if key in first))
    if PLANNER_CALLS["sharded"] in first:
        lines.append("  the planner's and the communicator's own calls, timed inside back-to-back forwards, their "
                     "waits for the GPU apart (us per sharded layer, by tokens/rank; in brackets with the GPU drained "
                     "before each forward; split by call in the JSON" + ("; on CPU ranks the waits for the gathers included" if
                                                  report["mode"].startswith("cpu") else "") + "): "
                     + "; ".join(f"{variant} " + ", ".join(_calls_cell(row, key) for row in report["rows"])
                                 for variant, key in PLANNER_CALLS.items() if key in first))
    if report.get("graph_error"):
        lines.append(f"  CUDA graph: not measured ({report['graph_error']})")
    return "\n".join(lines)


def short_table(report: dict[str, Any], variants: tuple[str, ...] = ("replicated", "sharded", "fsdp2")) -> str:
    """A narrow table for reading in a notebook: ms per step of ``variants`` (those the report holds)
    and the link floor, one row per tokens per rank; :func:`format_table` has every column."""
    cols = [v for v in variants if v in report["variants"]]
    emulated = "  (emulated: not GPU timings)" if report.get("emulation") else ""
    lines = [f"ms per step -- {report['mode']}, {report['world_size']} ranks, {report['model']}{emulated}",
             f"{'tokens/rank':>11}" + "".join(f"{c:>14}" for c in cols) + f"{'link floor':>12}"]
    for row in report["rows"]:
        cells = "".join(f"{row[c]:>14.2f}" if c in row else f"{'-':>14}" for c in cols)
        floor = f"{row['floor_ms']:>12.2f}" if row.get("floor_ms") else f"{'(N = 1)':>12}"
        lines.append(f"{row['tokens_per_rank']:>11,}{cells}{floor}")
    return "\n".join(lines)


def _calls_cell(row: dict[str, Any], key: str) -> str:
    drained = row.get(f"{key}_drained")
    return f"{row[key]:.1f}" + (f" ({drained:.1f})" if drained is not None else "")


def _host_cell(row: dict[str, Any], key: str) -> str:
    if f"{key}_q1" not in row:  # reports saved before the paired measurement: one difference of medians
        return f"{row[key]:.1f}"
    return f"{row[key]:.1f} ({row[key + '_q1']:.1f}..{row[key + '_q3']:.1f})"


#: Where the repository keeps the saved GPU runs: one folder per machine and day.
MEASUREMENTS = "docs/measurements"


def saved_reports(folder: str | Path = MEASUREMENTS, pattern: str = "bench_step_*.json") -> dict[str, dict[str, Any]]:
    """The ``bench step`` reports kept under ``folder`` -- in it or in its per-machine-and-day folders;
    each file is named after its machine and date -- by file stem."""
    paths = sorted(Path(folder).rglob(pattern), key=lambda p: p.name)
    return {p.stem: read_saved_report(p) for p in paths}


def pick_report(reports: dict[str, dict[str, Any]], *, holding: tuple[str, ...] = (),
                **fields: Any) -> dict[str, Any]:
    """The newest of ``reports`` (by date, then name) whose ``fields`` equal the given values and whose
    variants include every name in ``holding``: a notebook names what it wants, not a file."""
    found = [(r.get("date", ""), name, r) for name, r in reports.items()
             if all(r.get(k) == v for k, v in fields.items()) and set(holding) <= set(r.get("variants", ()))]
    if not found:
        raise NotFound(f"no saved report with {fields} holding {list(holding)}")
    return max(found, key=lambda f: (f[0], f[1]))[2]


def saved_path(name: str, folder: str | Path = MEASUREMENTS) -> Path:
    """The one file called ``name`` under ``folder`` (in whichever machine-and-day folder keeps it)."""
    found = sorted(Path(folder).rglob(name))
    if len(found) != 1:
        raise NotFound(f"{name}: {len(found)} files of that name under {folder}, not 1"
                                + (f" ({', '.join(map(str, found))})" if found else ""))
    return found[0]


def _figure(report: dict[str, Any]) -> Any:
    from wsharding.lab.viz.bench import step_figure  # plotly: absent on the GPU machine

    return step_figure(report)


def main(args: argparse.Namespace) -> int:
    check_output_path(str(json_path(args.json)) if args.json else "", "--json")  # before any rank starts
    gpus = gpu_count()
    if args.issue_thread and (not gpus or args.comm == "torch"):
        print("wsharding bench step: error: --issue-thread is a thread of our NCCL binding on GPUs (--comm nccl or "
              f"auto); {'this machine has no CUDA GPU' if not gpus else 'it gathers with torch.distributed here'}; "
              "leave --issue-thread out", file=sys.stderr)
        return 2
    backend = "nccl" if gpus else "gloo"
    n = args.ranks or (gpus if gpus else 2)
    model = args.model or ("llama8b-blocks" if gpus and not in_ci() else "tiny-blocks")
    tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens
              else ([1, 16, 256, 2048, 8192] if gpus else [1, 16, 256]))
    steps = args.steps or (20 if gpus else 5)
    repeats = args.repeats or (5 if gpus else 3)
    rpg = ceil_div(n, gpus) if gpus else 1
    if rpg > 1:
        backend = "gloo"  # several ranks per GPU: torch's NCCL refuses duplicate GPUs, our binding does not
    with RankCluster(n, backend=backend, ranks_per_gpu=rpg, task_timeout=3600) as cluster:
        results = cluster.run(step_bench_rank, model, tokens, steps=steps, comm=args.comm, fsdp=not args.no_fsdp,
                              graph=args.graph, repeats=repeats, mapped=args.mapped, issue_thread=args.issue_thread)
    report = summarize(results, model, args.comm)
    print(format_table(report))
    if args.json:
        save_report(report, args.json, _figure)
    return 0
