"""``wsharding demo``: the main job.

The decoder shaped like the deployment of SGLang's weight sharding for Kimi K3 is built twice on every
rank -- replicated, and with its replicated weights sharded over the group -- and both run the same
steps, with different token counts on every rank (an idle rank runs a one-token dummy step, so every
rank issues the same gathers). It prints a table and can write a JSON report and figures:

* outputs compared bit for bit (``max_abs_diff`` must be 0);
* bytes per rank: replicated R, sharded resident (measured from the storages), the formula;
* step time replicated vs sharded (lookahead) vs sharded without lookahead, measured side by side;
* the exposed part of the gathers, from the planner's trace.

Default: all GPUs with NCCL, else 4 CPU rank processes with gloo (emulated GPUs: every line says so).

Figures go to ``wsharding-out/`` ([Note: the default output folder] in :mod:`wsharding.lab.outdir`: at the
top of the checkout when run inside it, git-ignored; else in the current folder) unless ``--figures DIR``
says otherwise; the figures committed in the repository's ``figures/`` are only rewritten by asking for
it: ``--figures figures``.
Before any rank starts, the memory the preset needs is compared with what the machine has
(:mod:`wsharding.lab.memory`); a run that does not fit is refused with what to pass instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from wsharding.comm_by_name import COMMS, graph_unsupported, ours_supported, resolve_comm, shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.emulation import SHARED_GPU_TORCH_NOTE
from wsharding.core.runner import aligned_forward
from wsharding.core.units import ceil_div
from wsharding.cuda_graph import capture_graph
from wsharding.io_checks import MAX_REPORT_BYTES, read_regular_file
from wsharding.lab.args.demo import add_arguments as add_arguments
from wsharding.lab.bench.paired import PairedDifference, lookahead_vs_off, paired_ratio
from wsharding.lab.bench.rounds import round_orders
from wsharding.lab.bench.step import link_floor
from wsharding.lab.cliargs import (
    MAX_CPU_RANKS,
    MAX_RANKS_PER_GPU,
    InputError,
    check_output_path,
    emit_json,
)
from wsharding.lab.cluster import RankCluster, choose_backend
from wsharding.lab.memory import MemoryCheckError, check_demo_fits
from wsharding.lab.outdir import default_out_dir
from wsharding.lab.progress import Stages, rank_stage
from wsharding.lab.tasks.loading import build_pair_measured
from wsharding.models import decoder_config
from wsharding.models.equality import tokens_for
from wsharding.models.kv_cache import ranks_sharing_device, replicated_vs_sharded
from wsharding.runtime import gpu_count, in_ci

#: Said once under the header of a run on CPU ranks: why its ratios come with intervals and its finalize
#: peak is not held against the bound ([Note: CPU ranks measure noise]).
CPU_NOISE_NOTE = ("at this size CPU step times and process-level memory peaks are noise: a ratio can change "
                  "severalfold from one run to the next, so each comes with the interval its rounds give, and "
                  "the finalize peak (a process's resident set) is not compared with the weight-byte bound")
#: Said under the header of a one-rank run, where the sharded model holds more than the replicated one.
ONE_RANK_NOTE = ("one rank: nothing is shared, so the sharded model holds no less than the replicated one (its "
                 "slots or page padding come on top); the saving needs 2 or more ranks, and several ranks on one "
                 "GPU need NCCL >= 2.30, which 'wsharding info' checks")


def default_counts(world: int, steps: int) -> list[list[int]]:
    """Token counts per step and rank: uneven across ranks, one idle rank in the second step."""
    counts = []
    for s in range(steps):
        row = [1 + ((r * 5 + s * 3) % 7) * 4 for r in range(world)]
        if s == 1 and world > 1:
            row[world - 1] = 0
        counts.append(row)
    return counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: The demo's timed variants, in the order of its table.
TIMED_VARIANTS = ("replicated", "sharded", "sharded_no_lookahead")


def _time_steps(fn, steps: int, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    for s in range(steps):
        fn(s)
    _sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


def side_by_side(variants: dict[str, Any], planner: Any, comm: Any, steps: int, rounds: int) -> dict[str, list[float]]:
    """ms per step of each variant, ``rounds`` times after one untimed pass of each: each round times
    every variant for ``steps`` steps, starting with a different variant each round, so that what
    drifts during a run (clocks, the allocator, the other ranks) falls on every variant alike; the
    report takes the median. A variant named ``sharded_no_lookahead`` runs with lookahead off."""
    names = list(variants)
    samples: dict[str, list[float]] = {k: [] for k in names}
    # One untimed pass of every variant first: the first round runs slow for all (wsharding.lab.bench.rounds).
    for k in names:
        planner.lookahead = k != "sharded_no_lookahead"
        for s in range(steps):
            variants[k](s)
    for order in round_orders(names, rounds):
        for k in order:
            planner.lookahead = k != "sharded_no_lookahead"
            comm.barrier()
            samples[k].append(_time_steps(variants[k], steps, comm.device))
    planner.lookahead = True
    return samples


def decode_graph_times(replicated: torch.nn.Module, sharded: torch.nn.Module, comm: Any, *, tokens: int = 1,
                       steps: int = 20) -> dict[str, Any]:
    """Decode at ``tokens`` per rank, eager and replayed from a CUDA graph, replicated and sharded,
    measured one after the other in the same run (ms per step); and whether the two graphs'
    outputs are bitwise equal; and the link floor of the sharded step (``bench step``'s)."""
    dev = comm.device
    x = torch.arange(tokens, device=dev)
    runs: dict[str, Any] = {"eager_replicated": lambda: replicated(x), "eager_sharded": lambda: sharded(x)}
    g_rep, out_rep = capture_graph(runs["eager_replicated"], dev)
    g_sh, out_sh = capture_graph(runs["eager_sharded"], dev)
    runs["graph_replicated"], runs["graph_sharded"] = g_rep.replay, g_sh.replay
    times: dict[str, Any] = {"tokens": tokens}
    for name, fn in runs.items():
        fn()  # warm-up of this variant
        comm.barrier()
        times[name] = _time_steps(lambda _s, fn=fn: fn(), steps, dev)
    g_rep.replay()
    g_sh.replay()
    times["graph_equal"] = bool(torch.equal(out_rep, out_sh))
    times["bus_bandwidth_Bps"], times["floor_ms"] = link_floor(sharded.weight_sharding, comm)
    return times


def demo_rank(ctx: RankContext, preset: str, counts: list[list[int]], *, timed_steps: int = 5,
              group_size: int | None = None, comm: str = "torch", kv_context: int | None = None,
              graph: bool = False, rounds: int = 3, map_own_chunk: bool | str = "auto",
              issue_thread: bool = False, progress: str | None = None) -> dict[str, Any]:
    """On one rank: build both models, check equality over ``counts`` steps, time the three
    variants side by side (:func:`side_by_side`, ``rounds`` times), trace one lookahead step and one step without lookahead. Also what the
    saving buys: KV-cache tokens and sequences of ``kv_context`` tokens (default 4096 on GPUs, 256 on
    CPU ranks) replicated vs sharded, from the memory free after finalize. ``graph``: also one-token
    decode eager vs replayed from a CUDA graph (:func:`decode_graph_times`), where it can run.
    ``map_own_chunk``: the layers gather into views mapped over their chunks (NCCL >= 2.30; "auto": where it
    can run and holds no more, [Note: map_own_chunk="auto"]).
    ``issue_thread``: our NCCL communicator's native thread issues the gathers ([Note: the issue thread]).
    ``progress``: the command's name; rank 0 then tells each stage on standard error."""
    cfg = decoder_config(preset)
    comm = shard_comm_for(ctx, comm, group_size)
    if issue_thread:
        comm.set_issue_thread(True)
    rank_stage(ctx.rank, progress, f"building {preset} replicated and sharded ({cfg.layers} layers), finalize")
    replicated, sharded, load = build_pair_measured(cfg, comm, map_own_chunk=map_own_chunk)
    ws = sharded.weight_sharding
    planner = ws.planner
    # Right after finalize, as the weight-sharding design sizes its KV pool: before any step allocates
    # activations.
    kv_cache = replicated_vs_sharded(replicated, sharded, ws,
                                     context=kv_context or (4096 if comm.device.type == "cuda" else 256),
                                     share=ranks_sharing_device(ctx.world_size, comm.device))
    dev = comm.device

    def tok(step: int) -> torch.Tensor:
        return tokens_for(ctx.rank, step, counts, cfg.vocab, dev)

    equal, max_diff, gathers = [], 0.0, []
    rank_stage(ctx.rank, progress, f"comparing outputs bit for bit over {len(counts)} steps")
    with torch.no_grad():
        for s in range(len(counts)):
            x = tok(s)
            out = aligned_forward(sharded, x, sharded.dummy_tokens)
            gathers.append(planner.gathers_this_step)
            if out is not None:
                ref = replicated(x)
                equal.append(bool(torch.equal(ref, out)))
                max_diff = max(max_diff, float((ref.float() - out.float()).abs().max()))

        def step_sharded(s: int) -> None:
            aligned_forward(sharded, tok(s), sharded.dummy_tokens)

        def step_replicated(s: int) -> None:
            aligned_forward(replicated, tok(s), replicated.dummy_tokens)

        # the three variants measured side by side in the same run
        rank_stage(ctx.rank, progress, f"timing replicated, sharded and sharded without lookahead: {rounds} rounds "
                                       f"of {timed_steps} steps")
        samples = side_by_side({"replicated": step_replicated, "sharded": step_sharded,
                                "sharded_no_lookahead": step_sharded}, planner, comm, timed_steps, rounds)

        traces = {}
        for lookahead in (True, False):
            planner.lookahead = lookahead
            planner.trace_enabled = True
            comm.barrier()
            step_sharded(0)
            traces["lookahead" if lookahead else "no_lookahead"] = planner.finish_step()
        planner.trace_enabled = False
        planner.lookahead = True
        why_not = graph_unsupported(comm) if graph else None
        graphs = decode_graph_times(replicated, sharded, comm, steps=max(20, timed_steps)) if graph and not why_not else None

    tr = traces["lookahead"]
    gather_us = tr.gather_us()
    return {
        "rank": ctx.rank,
        "mode": comm.mode,
        "emulation": comm.emulation or ctx.emulation,
        "communicator": type(comm).__name__,
        "equal": equal,
        "max_abs_diff": max_diff,
        "gathers": gathers,
        "sharded_layers": ws.sharded_layer_ids,
        "replicated_bytes": ws.replicated_bytes(),
        "resident_bytes": ws.resident_bytes(),
        "formula_bytes": ws.formula_bytes(),
        "slot_bytes": ws.slots.slot_bytes,
        "map_own_chunk": ws.map_own_chunk,
        "map_own_chunk_reason": ws.map_own_chunk_reason,
        "issue_thread": comm.issuer is not None,
        "map_own_chunk_offered": comm.pool is not None,
        "slot_resident_bytes": ws.held_bytes()["slots"],
        "layout_bytes": {i: ws.layouts[i].total_bytes for i in ws.sharded_layer_ids},
        "step_ms": {k: statistics.median(v) for k, v in samples.items()},
        "step_ms_samples": samples,
        "exposed_gather_us": tr.exposed_gather_us(),
        "gather_us": gather_us,
        "exposed_gather_fraction": tr.exposed_gather_us() / gather_us if gather_us > 0 else 0.0,
        "trace": {k: v.records() for k, v in traces.items()},
        "tokens": [counts[s][ctx.rank % len(counts[0])] for s in range(len(counts))],
        "kv_cache": kv_cache,
        "load": load,
        "graph": graphs if graphs is not None else ({"error": why_not} if graph else None),
    }


def summarize(reports: list[dict[str, Any]], preset: str, world: int) -> dict[str, Any]:
    """The demo's JSON report from every rank's result."""
    r0 = reports[0]
    cfg = decoder_config(preset)
    mean = lambda key: sum(r["step_ms"][key] for r in reports) / len(reports)  # noqa: E731
    return {
        "mode": r0["mode"],
        "emulation": r0["emulation"],
        "preset": preset if isinstance(preset, str) else "custom",
        "world_size": world,
        "layers": cfg.layers,
        "sharded_layers": r0["sharded_layers"],
        "replicated_bytes_per_rank": r0["replicated_bytes"],
        "sharded_resident_bytes_per_rank": r0["resident_bytes"],
        "sharded_resident_bytes_all": [r["resident_bytes"] for r in reports],
        "communicator": r0["communicator"],
        "formula_bytes_per_rank": r0["formula_bytes"],
        "slot_bytes": r0["slot_bytes"],
        "map_own_chunk": r0["map_own_chunk"],
        "map_own_chunk_reason": r0.get("map_own_chunk_reason", ""),
        "map_own_chunk_offered": r0.get("map_own_chunk_offered", False),
        "issue_thread": r0.get("issue_thread", False),
        "slot_resident_bytes": r0["slot_resident_bytes"],
        "max_abs_diff": max(r["max_abs_diff"] for r in reports),
        "outputs_equal": all(all(r["equal"]) for r in reports),
        "gathers_per_step": r0["gathers"][0],
        "gathers_per_step_all": [r["gathers"] for r in reports],
        "step_ms": {k: mean(k) for k in TIMED_VARIANTS},
        "step_ms_per_rank": [r["step_ms"] for r in reports],
        # [Note: the mean and the slowest rank]
        "step_ms_slowest_rank": {k: max(r["step_ms"][k] for r in reports) for k in TIMED_VARIANTS},
        # per variant and round, the mean over ranks (the table's median is taken per rank)
        "step_ms_samples": {k: [sum(col) / len(col) for col in zip(*(r["step_ms_samples"][k] for r in reports),
                                                                  strict=True)]
                            for k in TIMED_VARIANTS},
        # per variant and round, the slowest rank (the slowest-rank line's ratio and its interval)
        "step_ms_samples_slowest_rank": {k: [max(col) for col in zip(*(r["step_ms_samples"][k] for r in reports),
                                                                     strict=True)]
                                         for k in TIMED_VARIANTS},
        "exposed_gather_fraction": sum(r["exposed_gather_fraction"] for r in reports) / len(reports),
        # does lookahead beat no lookahead beyond the run's noise? (paired rounds, the slowest rank)
        "lookahead_vs_off": lookahead_vs_off([r["step_ms_samples"] for r in reports]).as_dict(),
        "tokens_per_rank": [r["tokens"] for r in reports],
        "trace": [rec for r in reports for rec in r["trace"]["lookahead"]],
        "trace_no_lookahead": [rec for r in reports for rec in r["trace"]["no_lookahead"]],
        "kv_cache": r0.get("kv_cache"),
        "kv_cache_tokens_per_rank": [(r["kv_cache"]["replicated"]["tokens"], r["kv_cache"]["sharded"]["tokens"])
                                     for r in reports if r.get("kv_cache")],
        "load_peak_per_rank": [r["load"] for r in reports],
        "graph": graph_summary([r.get("graph") for r in reports]),
    }


def graph_summary(per_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Rank-mean decode times of :func:`decode_graph_times` (or the reason it did not run)."""
    if not per_rank or per_rank[0] is None:
        return None
    if "error" in per_rank[0]:
        return {"error": per_rank[0]["error"]}
    keys = ("eager_replicated", "eager_sharded", "graph_replicated", "graph_sharded")
    out: dict[str, Any] = {k: sum(r[k] for r in per_rank) / len(per_rank) for k in keys}
    out["tokens"] = per_rank[0]["tokens"]
    out["floor_ms"] = max(r["floor_ms"] for r in per_rank)
    out["graph_equal"] = all(r["graph_equal"] for r in per_rank)
    return out


def format_table(report: dict[str, Any]) -> str:
    mib = lambda b: f"{b / 2**20:10.3f} MiB"  # noqa: E731
    ms = report["step_ms"]
    lines = [
        f"wsharding demo -- mode {report['mode']}, {report['world_size']} ranks, preset {report['preset']}, "
        f"gathers by {report['communicator']}",
    ]
    if report["emulation"]:
        lines.append(f"  NOTE: {report['emulation']}")
    if on_cpu_ranks(report):
        lines.append(f"  NOTE: {CPU_NOISE_NOTE}")
    if report["world_size"] == 1:
        lines.append(f"  NOTE: {ONE_RANK_NOTE}")
    if report.get("issue_thread"):
        lines.append("  gathers issued by the communicator's native issue thread (--issue-thread)")
    lines += [
        f"  layers {report['layers']}, sharded {report['sharded_layers'][0]}..{report['sharded_layers'][-1]}, "
        f"gathers per step {report['gathers_per_step']}",
        f"  replicated weights per rank (R)      {mib(report['replicated_bytes_per_rank'])}",
        f"  sharded resident per rank (measured) {mib(report['sharded_resident_bytes_per_rank'])}",
        *([f"  formula R/N + padding + 2 slots      {mib(report['formula_bytes_per_rank'])}",
           f"  of which the two slots               {mib(2 * report['slot_bytes'])}"]
          if not report.get("map_own_chunk") else
          [f"  formula R/N + 2 (N-1)/N slots        {mib(report['formula_bytes_per_rank'])}  (map_own_chunk)",
           f"  of which the peers' slot pages       {mib(report['slot_resident_bytes'])}"]),
        # where mapping is a real choice (a communicator with a pool of windows to map): which, and why
        # (a report saved before the flag existed: our NCCL communicator was the one that offered it)
        *([f"  {report['map_own_chunk_reason']}"] if report.get("map_own_chunk_offered",
                                                                report.get("communicator") == "NcclCommunicator")
          and report.get("map_own_chunk_reason") else []),
        f"  outputs equal bit for bit: {'yes' if report['outputs_equal'] else 'NO'}   "
        f"max_abs_diff {report['max_abs_diff']}",
        step_time_line(ms, report.get("step_ms_samples")),
        *_ratio_lines(report.get("step_ms_samples")),
        *([_slowest_rank_line(report)] if report.get("step_ms_slowest_rank") and report["world_size"] > 1 else []),
        *([f"  {PairedDifference(**report['lookahead_vs_off']).line()}"] if report.get("lookahead_vs_off") else []),
        f"  exposed gather fraction (lookahead): {report['exposed_gather_fraction']:.3f}",
    ]
    kv = report.get("kv_cache")
    if kv:  # what the saving buys (rank 0): the KV-cache pool sized after finalize
        rep, sh = kv["replicated"], kv["sharded"]
        lines += [
            f"  KV cache, rank 0 ({kv['kv_bytes_per_token']} B per token; {kv['measured']}):",
            f"    tokens replicated {rep['tokens']:,} | sharded {sh['tokens']:,} ({sh['tokens'] - rep['tokens']:+,}); "
            f"sequences of {kv['context']} tokens {rep['sequences']:,} | {sh['sequences']:,}",
        ]
    g = report.get("graph")
    if g and "error" in g:
        lines.append(f"  CUDA graph: not measured ({g['error']})")
    elif g:
        lines.append(f"  decode, {g['tokens']} token/rank: eager replicated {g['eager_replicated']:.3f} ms | sharded "
                     f"{g['eager_sharded']:.3f} ms ({g['eager_sharded'] / g['eager_replicated']:.2f}x); CUDA graph "
                     f"replicated {g['graph_replicated']:.3f} ms | sharded {g['graph_sharded']:.3f} ms "
                     f"({g['graph_sharded'] / g['graph_replicated']:.2f}x), graph outputs equal: "
                     f"{'yes' if g['graph_equal'] else 'NO'}")
        if g["floor_ms"]:
            lines.append(f"    link floor of the sharded step {g['floor_ms']:.3f} ms (every layer's gather crosses the "
                         f"link): CUDA graph sharded / floor {g['graph_sharded'] / g['floor_ms']:.2f}x")
    if report.get("load_peak_per_rank"):
        lines += _finalize_lines(report["load_peak_per_rank"], mib)
    return "\n".join(lines)


def on_cpu_ranks(report: dict[str, Any]) -> bool:
    """Whether the report comes from CPU rank processes (ranks sharing a GPU are emulated too, but
    their times and peaks are the GPU's)."""
    return str(report.get("mode", "")).startswith("cpu")


def step_time_line(step_ms: dict[str, float], samples: dict[str, list[float]] | None) -> str:
    """The step times the ratio line below it is taken from: with per-round times, the median of each
    variant's rounds (each round the mean over the ranks), the same rounds whose per-round ratios give
    the ratio's median -- so a sharded median below the replicated one never sits above a ratio over
    1x unremarked. The median of the ratios and the ratio of the medians can still fall on the two
    sides of 1x when the rounds spread: the line then says that the noise decides which is faster.
    Without rounds (older reports), the stored ``step_ms``."""
    names = (("replicated", "replicated"), ("sharded", "sharded"), ("sharded_no_lookahead", "no lookahead"))
    if not samples or not samples.get("replicated"):
        return "  step time " + " | ".join(f"{n} {step_ms[k]:.3f} ms" for k, n in names if k in step_ms)
    med = {k: statistics.median(samples[k]) for k, _ in names if samples.get(k)}
    line = ("  step time " + " | ".join(f"{n} {med[k]:.3f} ms" for k, n in names if k in med)
            + f", the median of {len(samples['replicated'])} rounds (each the mean over the ranks)")
    split = [n for k, n in names[1:] if k in med
             and (med[k] > med["replicated"]) != (paired_ratio(samples[k], samples["replicated"]).median > 1)
             and med[k] != med["replicated"]]
    if split:
        line += (f"; {' and '.join(split)}: the medians and the per-round ratio fall on the two sides of 1x, "
                 "so noise decides which is faster")
    return line


def _ratio_lines(samples: dict[str, list[float]] | None, against: str = "replicated") -> list[str]:
    """[Note: CPU ranks measure noise]
    A ratio of two step times is printed only with the interval its paired rounds give
    (:func:`~wsharding.lab.bench.paired.paired_ratio`): on CPU ranks two runs of the same demo gave
    2.38x and 0.66x, and a bare ratio reads as a result. A report without per-round times gets no
    ratio at all. Likewise a measured peak is held against a bound only where both count the same
    bytes: the CUDA allocator's peak and the bound both count tensor bytes, while a CPU rank's peak is
    its process's resident set -- interpreter, gloo buffers and allocator pages included -- which no
    weight-byte bound describes."""
    if not samples or not samples.get(against):
        return []
    parts = [f"{name} / {against} {paired_ratio(samples[key], samples[against]).text()}"
             for key, name in (("sharded", "sharded"), ("sharded_no_lookahead", "no lookahead")) if key in samples]
    return [f"  {' | '.join(parts)}, the median of {len(samples[against])} per-round ratios"]


def _finalize_lines(load: list[dict[str, Any]], mib: Any) -> list[str]:
    """The finalize peak beside its bound where both count tensor bytes (the CUDA allocator); on CPU
    ranks the bound alone, and the resident set named as what it is ([Note: CPU ranks measure noise])."""
    peak = max(r["device_peak_bytes"] for r in load)
    bound = load[0]["bound_bytes"]
    if not load[0]["device_is_host"]:
        return [f"  finalize peak per rank (max, measured) {mib(peak)}  bound R/N + slots + one weight {mib(bound)}"]
    return [f"  finalize bound R/N + slots + one weight   {mib(bound)}  (CPU ranks measure only their process's "
            f"resident set, up to {peak / 2**20:.3f} MiB with the interpreter's and gloo's pages: not comparable)"]


def _slowest_rank_line(report: dict[str, Any]) -> str:
    """[Note: the mean and the slowest rank]
    The step times above are means over the ranks. The sharded ranks move together -- every gather is
    a collective, so each step waits for the rank with the most tokens -- while each replicated rank
    runs at its own pace, and with ragged batches (the demo's) their steps differ. The ratio against
    the replicated mean is the one the demo states: it counts that coupling as a cost of sharding,
    which it is for a group of free-running data-parallel ranks. Against the slowest replicated rank
    (what a group coupled anyway, by expert parallelism's all-to-all for example, runs at) it is
    printed beside it."""
    slow = report["step_ms_slowest_rank"]
    samples = report.get("step_ms_samples_slowest_rank")
    # [Note: CPU ranks measure noise]: a ratio only with its interval (older reports have no samples)
    ratio = f", sharded / replicated {paired_ratio(samples['sharded'], samples['replicated']).text()}" if samples else ""
    return (f"  slowest rank: replicated {slow['replicated']:.3f} ms | sharded {slow['sharded']:.3f} ms{ratio}; "
            "the ratios above are against the replicated ranks' mean (sharded ranks wait for each other at every "
            "gather, replicated ones do not)")


def write_figures(report: dict[str, Any], out_dir: str | Path, prefix: str = "") -> list[str]:
    """Timeline, slot occupancy and memory figures as HTML (and PNG when a Chromium is present),
    named ``<prefix>demo_*`` in ``out_dir``."""
    from wsharding.lab.viz.export import save_figure
    from wsharding.lab.viz.planner import memory_figure, slot_figure, timeline_figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = f"{report['mode']}, {report['world_size']} ranks" + (" (emulated)" if report["emulation"] else "")
    written = []
    for name, fig in (
        ("demo_timeline", timeline_figure(report["trace"], title=f"Gathers and compute per rank -- {label}")),
        ("demo_timeline_no_lookahead",
         timeline_figure(report["trace_no_lookahead"], title=f"Without lookahead -- {label}")),
        ("demo_slots", slot_figure(report["trace"], title=f"Slot A/B occupancy and gate waits -- {label}")),
        ("demo_memory", memory_figure(report, title=f"Weight bytes per rank -- {label}")),
    ):
        written += save_figure(fig, out / f"{prefix}{name}")
    return written


_REPORT_TODO = "pass a file written by 'wsharding demo --json PATH'"
REPORT_KEYS = ("mode", "emulation", "world_size", "preset", "communicator", "layers", "sharded_layers",
               "replicated_bytes_per_rank", "sharded_resident_bytes_per_rank", "formula_bytes_per_rank",
               "slot_bytes", "outputs_equal", "max_abs_diff", "gathers_per_step", "step_ms",
               "exposed_gather_fraction", "trace", "trace_no_lookahead")


def load_report(path: str) -> dict[str, Any]:
    """A saved demo report, checked: a missing, unreadable, non-JSON or wrong-shaped file is an
    :class:`InputError` that says which, before anything is drawn. A FIFO or a device (``/dev/zero``)
    is refused before it is opened -- reading one hung -- and so is a file over
    :data:`~wsharding.io_checks.MAX_REPORT_BYTES` ([Note: only regular files] in :mod:`wsharding.io_checks`)."""
    raw = read_regular_file(path, "--figures-from", max_bytes=MAX_REPORT_BYTES, todo=_REPORT_TODO, error=InputError)
    try:
        report = json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(f"--figures-from {path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         f"{_REPORT_TODO}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"--figures-from {path}: not JSON (byte {e.start} is not UTF-8 text); {_REPORT_TODO}") from None
    except RecursionError:  # [[[[...]]]] nested deeper than Python's stack: a traceback before
        raise InputError(f"--figures-from {path}: not a demo report (JSON nested too deep); {_REPORT_TODO}") from None
    if not isinstance(report, dict):
        raise InputError(f"--figures-from {path}: holds a JSON {type(report).__name__}, not a demo report")
    missing = [k for k in REPORT_KEYS if k not in report]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise InputError(f"--figures-from {path}: not a demo report (missing {', '.join(missing[:4])}{more}); "
                         f"{_REPORT_TODO}")
    if not isinstance(report["step_ms"], dict) or not isinstance(report["trace"], list):
        raise InputError(f"--figures-from {path}: step_ms must be an object and trace a list")
    return report


def default_ranks(backend: str, gpus: int) -> tuple[int, str]:
    """How many ranks the demo runs when ``--ranks`` is not given, and a line to print about it.

    Every GPU, or 4 CPU ranks. On a machine with ONE GPU a single rank would show no saving (nothing
    is shared), so where the NCCL found lets several ranks share a GPU (>= 2.30) two ranks run on
    it, their times time-sliced (the report says so); with an older NCCL one rank runs and the line
    says what to install."""
    if backend != "nccl":
        return 4, ""
    if gpus != 1:
        return gpus, ""
    from wsharding.accel.nccl.library import MIN_MULTI_RANK_GPU, NcclLibraryError, default_library

    try:
        library = default_library()
    except NcclLibraryError:
        library = None
    if library is not None and ours_supported() and library.supports(MIN_MULTI_RANK_GPU):
        return 2, (f"one GPU: running 2 ranks on it (NCCL {library.version_str} shares a GPU between ranks), so "
                   "the saving shows; their step times are time-sliced, not two GPUs' (--ranks 1 for one rank)")
    found = f"NCCL {library.version_str}" if library is not None else "no usable libnccl"
    return 1, (f"one GPU and {found}: one rank, which shows no saving; two ranks can share the GPU with NCCL >= "
               "2.30: pip install 'nvidia-nccl-cu12>=2.30' (cu13 for a CUDA 13 torch), then run again")


def check_arguments(args: argparse.Namespace, gpus: int) -> tuple[str, int]:
    """Refuse what cannot run, before any rank starts; return (backend, ranks)."""
    backend = args.backend if args.backend != "auto" else ("nccl" if gpus else "gloo")
    if backend == "nccl" and not gpus:
        raise InputError("--backend nccl needs CUDA GPUs and this machine has none; use --backend gloo "
                         "(CPU processes standing in for GPUs, emulated) or leave --backend auto")
    kind = COMMS.get(args.comm)  # None: "auto"
    if kind is not None and "cpu" not in kind.devices and not gpus:
        raise InputError(f"--comm {kind.name} ({kind.what}) needs CUDA GPUs and this machine has none; use "
                         "--comm torch or leave --comm auto")
    if kind is not None and not kind.runs_here():
        raise InputError(f"--comm {kind.name} needs {kind.needs}; use --comm torch")
    if args.map_own_chunk is True and not gpus:
        raise InputError("--map-own-chunk maps each layer's own chunk under its gather range: that needs our NCCL "
                         "binding on GPUs (--comm nccl, NCCL >= 2.30); this machine has no CUDA GPU; leave "
                         "--map-own-chunk out")
    if args.issue_thread and not gpus:
        raise InputError("--issue-thread starts a thread that issues the gathers of our NCCL binding on GPUs "
                         "(--comm nccl); this machine has no CUDA GPU; leave --issue-thread out")
    n = args.ranks or default_ranks(backend, gpus)[0]
    if backend == "gloo" and n > MAX_CPU_RANKS:
        raise InputError(f"--ranks {n}: at most {MAX_CPU_RANKS} CPU rank processes (each is a Python process "
                         "with torch); the code path is the same from 2 ranks on")
    if backend == "nccl" and ceil_div(n, gpus) > MAX_RANKS_PER_GPU:
        raise InputError(f"--ranks {n} on {gpus} GPU(s) would put {ceil_div(n, gpus)} ranks on one GPU; "
                         f"at most {MAX_RANKS_PER_GPU} per GPU")
    if args.json not in (None, "-"):
        check_output_path(args.json, "--json")
    if args.figures:
        check_output_path(args.figures, "--figures", directory=True)
    return backend, n


def main(args: argparse.Namespace) -> int:
    if args.figures_from:
        if args.figures:
            check_output_path(args.figures, "--figures", directory=True)
        report = load_report(args.figures_from)
        print(format_table(report))
        for path in write_figures(report, args.figures or default_out_dir(), args.prefix):
            print(f"  figure: {os.path.relpath(path)}")
        return 0
    gpus = gpu_count()
    backend, n = check_arguments(args, gpus)
    note = default_ranks(backend, gpus)[1] if args.ranks is None else ""
    if note:
        print(f"wsharding demo: {note}")
    preset = args.preset or ("k3-like" if backend == "nccl" and not in_ci() else "tiny-deep")
    counts = default_counts(n, args.steps)
    ranks_per_gpu = ceil_div(n, gpus) if backend == "nccl" and gpus else 1
    devices = choose_backend(n, backend, ranks_per_gpu)[1]
    try:
        check_demo_fits(preset, n, devices)
    except MemoryCheckError as e:
        print(f"wsharding demo: error: {e}", file=sys.stderr)
        return 2
    on_gpus = any(d is not None for d in devices)
    comm = resolve_comm(args.comm, on_gpus=on_gpus)
    if on_gpus and len(set(devices)) < n and comm == "torch":
        print(f"wsharding demo: error: {SHARED_GPU_TORCH_NOTE}; pass --comm nccl (NCCL >= 2.30)", file=sys.stderr)
        return 2
    if args.issue_thread and comm != "nccl":
        print("wsharding demo: error: --issue-thread is a thread of our NCCL binding (--comm nccl), and it gathers "
              "with torch.distributed here ('wsharding info' shows the libnccl found); leave --issue-thread out",
              file=sys.stderr)
        return 2
    if args.map_own_chunk is True and comm != "nccl":
        # --comm torch, or auto where libnccl does not support ours
        print("wsharding demo: error: --map-own-chunk needs our NCCL binding (--comm nccl), and it gathers with "
              "torch.distributed here ('wsharding info' shows the libnccl found); leave --map-own-chunk out",
              file=sys.stderr)
        return 2
    stages = Stages("wsharding demo")
    stages.start(f"starting {n} rank processes ({backend})")
    with RankCluster(n, backend=backend, ranks_per_gpu=ranks_per_gpu, task_timeout=1800) as cluster:
        stages.start("the ranks build, shard, compare and time the models")
        reports = cluster.run(demo_rank, preset, counts, timed_steps=args.timed_steps or (20 if on_gpus else 5),
                              comm=comm, graph=args.graph, rounds=args.rounds or (7 if on_gpus else 3),
                              map_own_chunk="auto" if args.map_own_chunk is None else args.map_own_chunk,
                              issue_thread=args.issue_thread, progress="wsharding demo")
        stages.start("stopping the rank processes")
    stages.done()
    report = summarize(reports, preset, n)
    if args.json != "-":
        print(format_table(report))
    written = emit_json(report, args.json)
    if written:
        print(f"  report: {written}")
    note = sys.stderr if args.json == "-" else sys.stdout
    if args.figures and importlib.util.find_spec("plotly") is None:
        # a GPU machine with torch only (no notebook stack): the run and its report stand without them
        print("  figures skipped: plotly is not installed (pip install plotly, or --figures '' to say so)", file=note)
    elif args.figures:
        for path in write_figures(report, args.figures, args.prefix):
            # with the JSON on stdout, the notes go to stderr so that stdout stays one JSON object
            print(f"  figure: {os.path.relpath(path)}", file=note)
    ok = report["outputs_equal"] and report["max_abs_diff"] == 0.0
    ok = ok and (report.get("graph") or {}).get("graph_equal", True)
    return 0 if ok else 1
