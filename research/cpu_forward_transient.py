"""Where a sharded forward's transient host memory goes on CPU ranks: 2 gloo ranks load the 8-block
Llama-shaped float32 ``cpu-blocks`` preset (100 MiB layers) (built on meta, ``load_sharded``), then run forwards of 1 and of ``tokens``
tokens with every allocation of 64 KiB or more mapped on its own (so the resident set follows what is
live) and the resident-set high-water mark reset before each. Beside each peak: the same forward
under ``torch.profiler`` with ``profile_memory``, which attributes the bytes torch's CPU allocator
handed out to the op that asked for them (the gather's own temporaries included), and the replicated
model's forward as the baseline for activations.

Run from the repository root: ``PYTHONPATH=. .venv/bin/python research/cpu_forward_transient.py [tokens] [depths]``
(depths: prefetch depths separated by commas, default 1). With ``GLIBC_DEFAULT=1`` large allocations
are left to glibc's own thresholds, as in a user's process: the resident set after the load, before and
after the trim that ``load_sharded`` does on CPU ranks."""

from __future__ import annotations

import gc
import os
import sys
import tempfile

import torch

MiB = 1 << 20


def transient(ctx, path: str, tokens: int, depth: int = 1) -> dict:
    from wsharding.checkpoint import load_sharded, save_checkpoint
    from wsharding.comm_by_name import shard_comm_for
    from wsharding.memory import map_large_allocations, peak_rss_bytes, reset_peak_rss, rss_bytes
    from wsharding.models.blocks import BLOCK_PRESETS, BLOCK_TARGETS, BlocksModel, build_blocks

    cfg = BLOCK_PRESETS["cpu-blocks"]
    c = shard_comm_for(ctx, "torch")
    if os.environ.get("GLIBC_DEFAULT") != "1":  # GLIBC_DEFAULT=1: glibc's own thresholds, as a user's process has
        map_large_allocations()
    if c.rank == 0 and not os.path.exists(path):
        save_checkpoint(build_blocks(cfg, "cpu", seed=0), path)
    c.barrier()
    gc.collect()
    rss_before_load = rss_bytes()
    ws = load_sharded(lambda: BlocksModel(cfg), path, "layers", BLOCK_TARGETS, c, **({"prefetch_depth": depth} if depth else {"lookahead": False}))
    model = ws.model
    out = {"rank": ctx.rank, "depth": depth, "held": ws.resident_bytes(), "R": ws.replicated_bytes(), "resident": ws.resident_bytes(),
           "largest_layer": ws.largest_weight_bytes(), "rss_after_load": rss_bytes() - rss_before_load}
    out["released_by_trim"] = ws.host_bytes_released  # load_sharded trims the heap on CPU ranks
    for n in (1, tokens):
        x = torch.randn(n, cfg.hidden)
        with torch.no_grad():
            model(x)  # warm: the first forward may allocate once
        gc.collect()
        steady = rss_bytes()
        reset_peak_rss()
        with torch.no_grad():
            model(x)
        out[f"forward_{n}"] = peak_rss_bytes() - steady
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.no_grad():
                model(x)
        ops = sorted(((e.key, e.self_cpu_memory_usage) for e in prof.key_averages() if e.self_cpu_memory_usage > 0),
                     key=lambda kv: -kv[1])
        out[f"alloc_by_op_{n}"] = ops[:6]
    ws.close()
    return out


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    depths = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1]
    from research.cpu_forward_transient import transient as task  # ranks import a task by its module's name
    from wsharding.lab.cluster import RankCluster

    with tempfile.TemporaryDirectory() as d, RankCluster(2, backend="gloo", task_timeout=1800) as cluster:
        for r in (r for depth in depths for r in cluster.run(task, os.path.join(d, "m.safetensors"), tokens, depth)):
            print(f"prefetch_depth {r['depth']}, rank {r['rank']}: R {r['R'] / MiB:.1f} MiB, resident {r['resident'] / MiB:.1f} MiB, largest weight "
                  f"{r['largest_layer'] / MiB:.1f} MiB; resident set above the start: before load_sharded's heap trim "
                  f"{(r['rss_after_load'] + r['released_by_trim']) / MiB:.1f} MiB, after {r['rss_after_load'] / MiB:.1f} "
                  f"MiB (bytes held {r['held'] / MiB:.1f} MiB, slots untouched until their first gather)")
            for n in (1, tokens):
                print(f"  forward of {n} tokens: RSS peak above steady {r[f'forward_{n}'] / MiB:.1f} MiB; bytes "
                      "handed out by op (MiB, summed over the step): "
                      + ", ".join(f"{k} {v / MiB:.1f}" for k, v in r[f"alloc_by_op_{n}"]))
