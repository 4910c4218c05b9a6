"""``wsharding bench load``: the start-up peak of loading a checkpoint, built with weights vs on meta.

Each rank loads the same safetensors checkpoint with :func:`~wsharding.checkpoint.load_sharded` twice,
in separate rounds: once into a model built the ordinary way (every weight allocated whole first, as
``build_model().to(device)`` does), once from the function that builds it (every parameter on meta:
:func:`~wsharding.empty_build.empty_parameters`). On GPUs the peak is
``torch.cuda.max_memory_allocated`` above what the rank held before building; on CPU ranks the
package's own count of the bytes its parameters held at the checkpoint's read (no RSS for the peak:
freed host memory may stay resident under glibc's malloc, and the number would say more about the
allocator than about the load). On CPU ranks the steady state is also shown as the process sees it:
the resident set beside the bytes held, what trimming the heap after the load gave back, and a
forward's transient (gloo's gather temporaries, see [Note: gloo's gather temporary] in
``wsharding/core/torch_backend.py``). Beside both: the bound ``R/N + slots + the rest + one weight`` and the replicated
R. Then one forward of ``--tokens`` tokens: its peak above the steady state.
"""

from __future__ import annotations

import argparse
import gc
import json
import warnings
from pathlib import Path
from typing import Any

import torch

import wsharding.checkpoint as checkpoint_module
from wsharding.checkpoint import BuiltWholeWarning, load_sharded, save_checkpoint
from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.units import MiB
from wsharding.lab.args.bench_load import add_arguments as add_arguments
from wsharding.lab.bench.ranks import auto_comm, bench_cluster
from wsharding.lab.bench.report import json_path
from wsharding.lab.cliargs import check_output_path
from wsharding.lab.tasks.loading import outside_allocator_bytes
from wsharding.memory import PeakMeter, peak_rss_bytes, reset_peak_rss, rss_bytes
from wsharding.models.blocks import BLOCK_TARGETS, BlocksModel, blocks_config, build_blocks
from wsharding.runtime import gpu_count, in_ci


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def _measuring(inner: Any, seen: dict[str, int]) -> Any:
    """``materialize`` that also records every parameter's bytes as the checkpoint's read starts."""

    def measuring(model: torch.nn.Module, device: torch.device) -> int:
        before = _param_bytes(model)
        made = inner(model, device)
        seen["at_read"] = before + made
        return made

    return measuring


def _reading(inner: Any, seen: dict[str, int], peak_now: Any) -> Any:
    """``load_checkpoint`` that records the device peak from the build through the read (before finalize
    allocates any chunk or slot: one allocator's peak, exact)."""

    def reading(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        seen["through_read"] = peak_now()
        return out

    return reading


def load_peak_rank(ctx: RankContext, preset: str, path: str, tokens: int, comm: str = "auto") -> dict[str, Any]:
    """On one rank: rank 0 writes the checkpoint; then each way of building loads it and is measured."""
    c = shard_comm_for(ctx, comm)
    dev, cuda = c.device, c.device.type == "cuda"
    cfg = blocks_config(preset)
    if c.rank == 0 and not Path(path).exists():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(build_blocks(preset, "cpu", seed=0), path)
    c.barrier()
    x = build_blocks(cfg.with_(layers=1), "cpu").inputs(tokens, seed=ctx.rank, device=dev)
    out: dict[str, Any] = {"rank": ctx.rank, "mode": c.mode, "emulation": c.emulation or ctx.emulation}
    outside = outside_allocator_bytes(c)  # our NCCL's windows are not in torch's allocator
    for how in ("whole", "meta"):
        gc.collect()
        if cuda:
            torch.cuda.synchronize(dev)
        base, out0 = (torch.cuda.memory_allocated(dev), outside()) if cuda else (0, 0)
        rss0 = rss_bytes()
        seen: dict[str, int] = {}
        inner, inner_read = checkpoint_module.materialize, checkpoint_module.load_checkpoint

        def peak_now(base: int = base, out0: int = out0) -> int:
            return torch.cuda.max_memory_allocated(dev) - base + outside() - out0 if cuda else 0

        # map_host=False: on CPU ranks the allocator as load_sharded itself leaves it, not as a meter sets it
        with PeakMeter(dev, outside_allocator=outside, map_host=False) as meter:
            checkpoint_module.materialize = _measuring(inner, seen)
            checkpoint_module.load_checkpoint = _reading(inner_read, seen, peak_now)
            try:
                if how == "whole":
                    with torch.device(dev):
                        model = BlocksModel(cfg)  # every weight allocated whole, as a model built with its weights
                    whole_before = _param_bytes(model)
                    with warnings.catch_warnings():  # the peak it names is what this row measures
                        warnings.simplefilter("ignore", BuiltWholeWarning)
                        ws = load_sharded(model, path, "layers", BLOCK_TARGETS, c)
                else:
                    whole_before = 0

                    def build() -> BlocksModel:
                        with torch.device(dev):
                            return BlocksModel(cfg)

                    ws = load_sharded(build, path, "layers", BLOCK_TARGETS, c)
            finally:
                checkpoint_module.materialize, checkpoint_module.load_checkpoint = inner, inner_read
        model = ws.model
        load_peak = seen["through_read"] if cuda else max(whole_before, seen["at_read"])
        # the whole load, finalize included: torch's row shards are freed layer by layer while our NCCL's
        # windows grow -- two allocators, so the meter's sum of each one's maximum is an upper bound
        # ([Note: two allocators])
        finalize_bound = meter.result.device_peak_bytes if cuda else None
        steady = torch.cuda.memory_allocated(dev) - base + outside() - out0 if cuda else None
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        host: dict[str, int] | None = None
        if not cuda:
            # the resident set, not the package's count: what the rank's process really keeps (the meter
            # maps every large allocation on its own, so freed weights leave the resident set)
            host = {"rss_after_load": rss_bytes() - rss0, "trimmed": ws.host_bytes_released,
                    "load_rss_peak": meter.result.host_peak_bytes, "peak_exact": meter.result.host_exact}
            with torch.no_grad():
                model(x)  # touches the slots' pages, which stay untouched until their first gather
            host["rss_steady"] = rss_bytes() - rss0
            reset_peak_rss()
            steady_abs = rss_bytes()
        with torch.no_grad():
            model(x)
        if cuda:
            torch.cuda.synchronize(dev)
        else:
            host["forward_transient"] = peak_rss_bytes() - steady_abs
            host["largest_layer"] = max(lay.total_bytes for lay in ws.layouts.values())
        forward_peak = torch.cuda.max_memory_allocated(dev) - base + outside() - out0 if cuda else None
        rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if not any(f".{t}." in f".{n}" for t in BLOCK_TARGETS))
        out[how] = {
            "load_peak": load_peak, "finalize_upper": finalize_bound, "steady": steady, "forward_peak": forward_peak,
            "built_whole": ws.built_whole_bytes, "replicated": ws.replicated_bytes(),
            "bound": ws.formula_bytes() + ws.largest_weight_bytes() + rest, "resident": ws.resident_bytes(),
            "formula": ws.formula_bytes(), "rest": rest, "measured": "max_memory_allocated" if cuda else "bytes held",
            "host": host,
        }
        ws.close()
        del model, ws
    return out


def format_table(results: list[dict[str, Any]], preset: str, tokens: int) -> str:
    r0 = results[0]
    lines = [f"wsharding bench load -- {preset}, {len(results)} ranks, mode {r0['mode']}"]
    if r0["emulation"]:
        note = r0["emulation"]
        lines.append(f"  NOTE: {note if note.startswith('emulated') else 'emulated: ' + note}")
    w = r0["whole"]
    lines.append(f"  R (the sharded weights, replicated) {w['replicated'] / MiB:.1f} MiB; bound R/N + slots + rest + one "
                 f"weight {w['bound'] / MiB:.1f} MiB; resident after finalize {w['resident'] / MiB:.1f} MiB "
                 f"(formula {w['formula'] / MiB:.1f})")
    lines.append("  peak from the build through the read, MiB per rank (" + (
        "torch.cuda.max_memory_allocated; no chunk or slot exists yet" if w["measured"] == "max_memory_allocated"
        else "the parameters' bytes as the checkpoint's read starts") + "):")
    lines.append("  rank | built with weights | built on meta | meta / bound | whole / meta")
    for r in results:
        a, b = r["whole"], r["meta"]
        lines.append(f"  {r['rank']:>4} | {a['load_peak'] / MiB:18.1f} | {b['load_peak'] / MiB:13.1f} | "
                     f"{b['load_peak'] / b['bound']:12.2f} | {a['load_peak'] / b['load_peak']:11.2f}x")
    if r0["meta"]["finalize_upper"] is not None:
        lines.append("  the whole load, finalize included (row shards freed as chunks and slots are allocated, two "
                     "allocators): at most "
                     + ", ".join(f"{r['whole']['finalize_upper'] / MiB:.1f} / {r['meta']['finalize_upper'] / MiB:.1f}"
                                 for r in results) + " MiB (with weights / on meta, per rank; the sum of each "
                     "allocator's own peak, an upper bound)")
    if r0["meta"]["forward_peak"] is not None:
        lines.append(f"  one forward of {tokens} tokens per rank: peak above steady state, MiB per rank:")
        for r in results:
            b = r["meta"]
            lines.append(f"  {r['rank']:>4} | steady {b['steady'] / MiB:.1f} | forward peak {b['forward_peak'] / MiB:.1f} "
                         f"| +{(b['forward_peak'] - b['steady']) / MiB:.1f}")
    if r0["meta"]["host"] is not None:
        lines.append("  host memory on meta, MiB per rank (the resident set above the rank's own before the build; "
                     "large allocations mapped one by one by load_sharded):")
        for r in results:
            b, h = r["meta"], r["meta"]["host"]
            lines.append(f"  {r['rank']:>4} | held {(b['resident'] + b['rest']) / MiB:.1f} | resident set after the "
                         f"load {h['rss_after_load'] / MiB:.1f} (slots untouched), after a forward "
                         f"{h['rss_steady'] / MiB:.1f} | heap trim gave back {h['trimmed'] / MiB:.1f}")
        lines.append("  the whole load on meta, finalize included: peak of the resident set above the rank's own "
                     "before the build, MiB per rank (glibc's allocator as load_sharded leaves it):")
        for r in results:
            b, h = r["meta"], r["meta"]["host"]
            lines.append(f"  {r['rank']:>4} | peak {h['load_rss_peak'] / MiB:.1f} | bound {b['bound'] / MiB:.1f} | "
                         f"{'within' if h['load_rss_peak'] <= b['bound'] else 'ABOVE'} the bound"
                         + ("" if h["peak_exact"] else " (the process's lifetime peak: its mark could not be reset)"))
        h = r0["meta"]["host"]
        lines.append(f"  a forward's transient (rank 0): +{h['forward_transient'] / MiB:.1f} MiB of resident set, "
                     f"{h['forward_transient'] / h['largest_layer']:.2f} x the largest layer "
                     f"({h['largest_layer'] / MiB:.1f} MiB); gloo's all-gather flattens its output into a temporary "
                     "of the whole layer, one per gather in flight: about 2 x at depth >= 1, whatever --tokens")
        if h["largest_layer"] < 8 * MiB:
            lines.append("  (at this size the resident set is noise -- the interpreter's own allocations move it as "
                         "much: --model cpu-blocks shows the host numbers at 100 MiB layers)")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    check_output_path(str(json_path(args.json)) if args.json else "", "--json")
    gpus = gpu_count()
    n = args.ranks or (gpus if gpus else 2)
    model = args.model or ("llama8b-blocks" if gpus and not in_ci() else "tiny-blocks")
    path = str(Path(args.checkpoint.format(model=model)).resolve())
    with bench_cluster(n, task_timeout=3600) as cluster:
        results = cluster.run(load_peak_rank, model, path, args.tokens, comm=auto_comm(args.comm))
    print(format_table(results, model, args.tokens))
    if args.json:
        out = json_path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": model, "tokens": args.tokens, "ranks": results}, indent=1))
        print(f"  wrote {out}")
    return 0
