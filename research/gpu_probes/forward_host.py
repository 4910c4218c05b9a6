"""Where the sharded forward's extra host time goes, beyond the bare planner loop of ``bench step``.

    torchrun --nproc-per-node N research/gpu_probes/forward_host.py [MODEL] [TOKENS]   # JSON on rank 0

Host microseconds per sharded layer that each variant adds over the replicated forward, measured in
pairs (``wsharding.lab.bench.step.paired_host_us``: one call of each back to back, the GPU drained
before each call):

  * ``replicated`` again: the noise floor of the measurement;
  * ``hooks only``: the replicated model with two no-op module hooks per block (what ``shard_blocks`` used to add);
  * ``sharded, gathers no-op``: the sharded model whose gathers neither start nor wait (hooks + planner);
  * ``sharded``, ``sharded, direct launch`` and ``sharded, lookahead off``;
and the functions whose own host time differs most between one sharded and one replicated forward
under cProfile (the profiler's overhead inflates both alike; read the counts and the order).

Then what the layer's own torch ops pay for what runs beside them: the replicated model with a wrapper
on each block that does one thing before the block, host microseconds per block over the replicated
forward (``actions``): nothing; 5 us of Python; a cuEventRecord on the compute stream (once, twice, and
through torch), and on a side stream; a
cuStreamWaitEvent of the compute stream on a completed event of a side stream; a small captured copy
launched on a side stream that the compute stream then waits for (the shape of one gather).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch
import torch.distributed as dist
from probe_report import finish, nccl_rank

from wsharding.core.runner import shard_blocks
from wsharding.lab.bench.step import paired_host_us, planner_host_us
from wsharding.models.blocks import BLOCK_TARGETS, build_blocks

PAIRS = 400


def own_times(fn, calls: int = 20) -> dict[str, tuple[int, float]]:
    """(calls, own seconds) per function over ``calls`` calls of ``fn`` under cProfile."""
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    return {f"{os.path.basename(f)}:{line}({name})": (nc, tt / calls) for (f, line, name), (_cc, nc, tt, _ct, _c)
            in stats.items()}


def action_costs(model, x, layers: int, dev: torch.device) -> dict[str, dict[str, float]]:
    """Host us per block that one action before each block adds to ``model``'s forward (paired)."""
    from wsharding.accel.captured_launch import CapturedLaunch
    from wsharding.accel.cuda_driver import driver

    cu = driver()
    compute = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    ev_compute, ev_side = torch.cuda.Event(), torch.cuda.Event()
    ev_compute.record(compute)
    ev_side.record(side)
    c, sd = compute.cuda_stream, side.cuda_stream
    src, dst = torch.empty(1 << 20, dtype=torch.uint8, device=dev), torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    copy = CapturedLaunch(sd, lambda s: cu.memcpy_dtod_async(dst.data_ptr(), src.data_ptr(), 1 << 20, s), "probe copy")

    def busy() -> None:
        end = time.perf_counter() + 5e-6
        while time.perf_counter() < end:
            pass

    def side_copy() -> None:
        copy.launch(sd)
        cu.event_record(ev_side.cuda_event, sd)
        cu.stream_wait_event(c, ev_side.cuda_event)

    def twice() -> None:
        cu.event_record(ev_compute.cuda_event, c)
        cu.event_record(ev_compute.cuda_event, c)

    actions = {"nothing": lambda: None, "python 5 us": busy,
               "cuEventRecord on compute": lambda: cu.event_record(ev_compute.cuda_event, c),
               "cuEventRecord on compute, twice": twice,
               "torch Event.record on compute": lambda: ev_compute.record(compute),
               "cuEventRecord on a side stream": lambda: cu.event_record(ev_side.cuda_event, sd),
               "compute waits a side event": lambda: cu.stream_wait_event(c, ev_side.cuda_event),
               "side graph copy + compute waits it": side_copy}
    now = ["nothing"]
    for b in model.layers:
        inner = b.forward

        def forward(*a, _inner=inner):
            actions[now[0]]()
            return _inner(*a)

        b.forward = forward

    def plain() -> None:
        now[0] = "nothing"
        model(x)

    out = {}
    for name in actions:
        def run(name=name) -> None:
            now[0] = name
            model(x)

        for _ in range(3):
            run()
        dist.barrier()
        m, q1, q3 = paired_host_us(plain, run, layers, PAIRS, dev)
        out[name] = {"median": m, "q1": q1, "q3": q3}
    torch.cuda.synchronize(dev)
    copy.destroy()
    return out


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "llama8b-blocks"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    rank, world, gpus, dev, comm = nccl_rank()
    replicated = build_blocks(model, dev)
    hooked = build_blocks(model, dev)
    sharded = build_blocks(model, dev)
    ws = shard_blocks(sharded, "layers", BLOCK_TARGETS, comm)
    for b in hooked.layers:  # the two hooks per block shard_blocks used to add, doing nothing
        b.register_forward_pre_hook(lambda _m, _a: None)
        b.register_forward_hook(lambda _m, _a, _o: None)
    hooked.register_forward_pre_hook(lambda _m, _a: None)
    hooked.register_forward_hook(lambda _m, _a, _o: None)
    x = replicated.inputs(tokens, rank, dev)
    layers = len(ws.sharded_layer_ids)
    gathers = list(ws.planner.gathers.values())
    out: dict = {"model": model, "tokens_per_rank": tokens, "world_size": world, "gpus": gpus, "mode": comm.mode,
                 "emulation": comm.emulation, "nccl": comm.library.describe(), "sharded_layers": layers,
                 "pairs": PAIRS, "launch": sorted({g.launch for g in gathers})}

    def rep() -> None:
        replicated(x)

    def shd() -> None:
        sharded(x)

    def set_launch(how: str) -> None:
        for g in gathers:
            g.launch = how

    with torch.no_grad():
        assert torch.equal(replicated(x), sharded(x))
        for fn in (rep, shd, lambda: hooked(x)):
            for _ in range(3):
                fn()
        added: dict[str, list[float]] = {}

        def pair(name: str, fn) -> None:
            dist.barrier()
            added[name] = list(paired_host_us(rep, fn, layers, PAIRS, dev))

        pair("replicated", rep)
        pair("hooks only", lambda: hooked(x))
        pair("sharded", shd)
        if "graph" in out["launch"]:
            set_launch("direct")
            pair("sharded, direct launch", shd)
            set_launch("graph")
        ws.planner.lookahead = False
        pair("sharded, lookahead off", shd)
        ws.planner.lookahead = True
        for g in gathers:  # nothing is gathered: only the host time counts here
            g.start = lambda gate=None, marks=None: None
            g.wait = lambda stream=None: None
        pair("sharded, gathers no-op", shd)
        for g in gathers:
            del g.start, g.wait
        out["added_host_us_per_layer"] = {k: {"median": v[0], "q1": v[1], "q3": v[2]} for k, v in added.items()}
        out["bare_loop_us_per_layer"] = planner_host_us(ws)
        prof_rep, prof_shd = own_times(rep), own_times(shd)
        out["actions_host_us_per_block"] = action_costs(hooked, x, layers, dev)
    diff = []
    for key, (n, t) in prof_shd.items():
        n0, t0 = prof_rep.get(key, (0, 0.0))
        diff.append((t - t0, key, n // 20, n0 // 20))
    diff.sort(reverse=True)
    out["profile_top_added"] = [{"function": k, "added_us_per_forward": d * 1e6, "calls_sharded": n, "calls_replicated": n0}
                                for d, k, n, n0 in diff[:25]]
    out["profile_total_us_per_forward"] = {"replicated": sum(t for _, t in prof_rep.values()) * 1e6,
                                           "sharded": sum(t for _, t in prof_shd.values()) * 1e6}
    finish(f"forward_host_{world}ranks_{gpus}gpu.json", out, ws, comm)


if __name__ == "__main__":
    main()
