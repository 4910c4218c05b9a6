"""Rank tasks of the draft model's first-layer prefetch (notebook 03 section 7, ``wsharding bench draft``).

One step of speculative decoding, as in SGLang's weight sharding for Kimi K3: the target model's
forward, a region that is not a layer (the design's ~4 ms commit step; here a labelled stand-in,
:func:`commit_region`), then the draft model's forward. The draft's first sharded layer is gathered in
one of three ways (``mode``):

* ``"dedicated"``: ``FirstLayerPrefetch.prefetch()`` on its own stream after the target, so
  the gather runs under the commit region ([Note: the draft's first layer] in ``wsharding/core/first_layer.py``);
* ``"shared"``: the same prefetch on the stream the target's gathers use (our NCCL comm's gather stream;
  the torch backend issues its gathers from the compute stream, so that stream) -- what the design
  measured at ~25 us of overlap;
* ``"inline"``: no prefetch; ``FirstLayerPrefetch.wait()`` finds none (a cold start) and gathers now.

Exposed time is what the compute stream spends in ``FirstLayerPrefetch.wait()``: CUDA events recorded
on the compute stream just before and after it (CUDA), or the wall time of the call (CPU ranks, where
gloo gathers on its own thread; there are no streams, so ``"shared"`` does not apply).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument, Unsupported
from wsharding.core.sharding import WeightSharding
from wsharding.models import ToyDecoder, decoder_config
from wsharding.models.draft import DraftDecoder, build_draft_pair, draft_config
from wsharding.models.equality import tokens_for

MODES = ("dedicated", "shared", "inline")
#: What the CPU-rank version runs: gloo has no streams to share.
CPU_MODES = ("dedicated", "inline")
COMMIT_WORDS = "stand-in for the weight-sharding design's commit step (not a layer, not a real commit)"


def commit_region(device: torch.device, ms: float, kind: str = "auto") -> tuple[Callable[[], None], str]:
    """A callable that keeps the compute side busy for about ``ms`` milliseconds, and its label.

    ``kind``: ``"matmul"`` (chained bf16 GEMMs on the current stream, the count calibrated once to
    ``ms``), ``"sleep"`` (the host sleeps: on CPU ranks gloo's thread gathers meanwhile), or ``"auto"``
    (matmul on CUDA, sleep on CPU). It stands for the design's commit step and is labelled as such.
    """
    if kind == "auto":
        kind = "matmul" if device.type == "cuda" else "sleep"
    if ms <= 0:
        return (lambda: None), "no region between the models"
    if kind == "sleep":
        def sleep() -> None:
            time.sleep(ms / 1e3)
        return sleep, f"{COMMIT_WORDS}: host sleep of {ms:g} ms"
    if kind != "matmul":
        raise InvalidArgument(f"commit region kind {kind!r}: use 'matmul', 'sleep' or 'auto'")
    n = 2048 if device.type == "cuda" else 256
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(device, dtype) / n**0.5
    b = a.clone()

    def gemm() -> None:
        torch.mm(a, b, out=b)

    per = _time_ms(gemm, device, reps=5)
    count = max(1, round(ms / per))

    def region() -> None:
        for _ in range(count):
            gemm()

    return region, f"{COMMIT_WORDS}: {count} x {n}^3 {str(dtype).split('.')[-1]} GEMM (~{count * per:.2f} ms)"


def _time_ms(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def shared_stream(comm: Any) -> torch.cuda.Stream:
    """The stream the target model's gathers use: the communicator's gather stream (our NCCL
    binding's), or, for a backend that gathers from the compute stream (torch's), the current stream."""
    return comm.stream if comm.stream is not None else torch.cuda.current_stream(comm.device)


def prepare(draft: DraftDecoder, mode: str, comm: Any) -> None:
    """Between the target and the region: issue the draft's first gather as ``mode`` says."""
    planner = draft.planner
    ahead = draft.first_prefetch
    if mode == "dedicated":
        ahead.prefetch()
    elif mode == "shared":
        ahead.prefetch(shared_stream(comm) if planner.cuda else None)
    elif mode != "inline":
        raise InvalidArgument(f"mode {mode!r}: use one of {MODES}")


def check_modes(modes: Sequence[str]) -> list[str]:
    """``modes`` as a list, refusing a name that is not one of :data:`MODES`."""
    for mode in modes:
        if mode not in MODES:
            raise InvalidArgument(f"mode {mode!r}: use one of {MODES}")
    return list(modes)


def _models(ctx: RankContext, preset: str, comm_name: str, draft_layers: int):
    """The sharded target, the replicated draft and the sharded draft on this rank, kept in
    ``ctx.store`` (one configuration at a time: a notebook must not pile models up)."""
    cfg = decoder_config(preset)
    key = ("draft_tasks.models", cfg, comm_name, draft_layers)
    if key not in ctx.store:
        for k in [k for k in ctx.store if isinstance(k, tuple) and k and k[0] == "draft_tasks.models"]:
            del ctx.store[k]
        comm = shard_comm_for(ctx, comm_name)
        ws = WeightSharding(comm, sharded_layers=range(1, cfg.layers))
        target = ToyDecoder(cfg, seed=0, weight_sharding=ws, device=comm.device).eval()
        ws.finalize()
        draft_rep, draft = build_draft_pair(draft_config(cfg, draft_layers), comm)
        ctx.store[key] = (comm, cfg, target, draft_rep, draft)
    return ctx.store[key]


def draft_equality(ctx: RankContext, preset: str, counts: Sequence[Sequence[int]], *,
                   modes: Sequence[str] = CPU_MODES, comm: str = "torch", draft_layers: int = 2,
                   commit_ms: float = 1.0) -> dict[str, Any]:
    """Steps of target + region + draft in every ``mode``; the sharded draft's logits against the
    replicated draft's, bit for bit. Also the two paths a caller may take by mistake: a prefetch never
    waited on before the draft's step (``"no_wait"``), and no call at all (``"no_calls"``).

    ``counts[step][rank]`` tokens per step (at least one: a draft step always has a token). Returns per
    mode: equality per step, the draft's gathers per step (one per sharded layer, the prefetched one
    included), and the planner's prefetch and cold-start counts.
    """
    modes = check_modes(modes)
    comm_, cfg, target, draft_rep, draft = _models(ctx, preset, comm, draft_layers)
    region, label = commit_region(comm_.device, commit_ms)
    planner = draft.planner
    ahead = draft.first_prefetch
    results: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for mode in [*modes, "no_wait", "no_calls"]:
            prefetches, cold = ahead.prefetches, ahead.cold_starts
            equal, gathers = [], []
            for step in range(len(counts)):
                n = max(1, counts[step][ctx.rank % len(counts[step])])
                x = tokens_for(ctx.rank, step, [[n]], cfg.vocab, comm_.device)
                target(x)
                if mode in MODES:
                    prepare(draft, mode, comm_)
                    region()
                    ahead.wait()
                elif mode == "no_wait":
                    ahead.prefetch()
                    region()
                logits = draft(x)
                gathers.append(planner.gathers_this_step)
                equal.append(bool(torch.equal(logits, draft_rep(x))))
            results[mode] = {"equal": equal, "gathers": gathers, "prefetches": ahead.prefetches - prefetches,
                             "cold_starts": ahead.cold_starts - cold}
    return {"rank": ctx.rank, "mode": comm_.mode, "emulation": ctx.emulation, "region": label,
            "first_layer": ahead.first_layer, "sharded_layers": draft.weight_sharding.sharded_layer_ids,
            "modes": results}


def draft_exposed(ctx: RankContext, preset: str, *, tokens: int = 8, steps: int = 20, warmup: int = 3,
                  commit_ms: float = 4.0, region_kind: str = "auto", comm: str = "auto", draft_layers: int = 2,
                  modes: Sequence[str] | None = None) -> dict[str, Any]:
    """Exposed time of the draft's first-layer gather per mode, over ``steps`` timed steps of
    target + region + draft (after ``warmup``), and the mean step time. On CUDA the exposed time is
    taken by events on the compute stream around ``FirstLayerPrefetch.wait()``; on CPU ranks it is
    the wall time of that call.
    """
    comm_, cfg, target, _rep, draft = _models(ctx, preset, comm, draft_layers)
    dev = comm_.device
    cuda = dev.type == "cuda"
    modes = check_modes(modes or (MODES if cuda else CPU_MODES))
    region, label = commit_region(dev, commit_ms, region_kind)
    ahead = draft.first_prefetch
    x = tokens_for(ctx.rank, 0, [[tokens]], cfg.vocab, dev)
    prefetches, cold = ahead.prefetches, ahead.cold_starts
    rows = []
    with torch.no_grad():
        for mode in modes:
            exposed, step_ms = [], []
            for s in range(warmup + steps):
                if cuda:
                    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                    marks[0].record()
                else:
                    t0 = time.perf_counter()
                target(x)
                prepare(draft, mode, comm_)
                region()
                if cuda:
                    marks[1].record()
                else:
                    w0 = time.perf_counter()
                ahead.wait()
                if cuda:
                    marks[2].record()
                else:
                    w1 = time.perf_counter()
                draft(x)
                if cuda:
                    marks[3].record()
                    torch.cuda.synchronize(dev)
                    if s >= warmup:
                        exposed.append(marks[1].elapsed_time(marks[2]) * 1e3)
                        step_ms.append(marks[0].elapsed_time(marks[3]))
                elif s >= warmup:
                    exposed.append((w1 - w0) * 1e6)
                    step_ms.append((time.perf_counter() - t0) * 1e3)
                comm_.barrier()  # every rank starts the next step together: the gathers pair up
            rows.append({"mode": mode, "exposed_us": exposed, "step_ms": step_ms,
                         "exposed_us_median": _median(exposed), "step_ms_median": _median(step_ms)})
    first = ahead.first_layer
    return {"rank": ctx.rank, "mode": comm_.mode, "emulation": comm_.emulation or ctx.emulation,
            "communicator": type(comm_).__name__, "preset": preset, "draft_layers": draft_layers,
            "first_layer_bytes": draft.weight_sharding.layouts[first].total_bytes, "region": label,
            "commit_ms": commit_ms, "tokens": tokens, "rows": rows,
            "cold_starts": ahead.cold_starts - cold, "prefetches": ahead.prefetches - prefetches}


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    if not v:
        return 0.0
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def draft_graph_replay(ctx: RankContext, preset: str, tokens: int = 8, replays: int = 3, *, comm: str = "torch",
                       commit_ms: float = 1.0) -> dict[str, Any]:
    """CUDA only: the draft's forward captured in a CUDA graph *without* its first layer's gather, which
    stays outside: every step runs the target eagerly, prefetches, runs the region, waits, then replays
    the graph. Each replay's logits against the replicated draft's, bit for bit."""
    comm_, cfg, target, draft_rep, draft = _models(ctx, preset, comm, 2)
    dev = comm_.device
    if dev.type != "cuda":
        raise Unsupported("draft_graph_replay needs CUDA ranks")
    region, label = commit_region(dev, commit_ms)
    planner = draft.planner
    ahead = draft.first_prefetch
    static = torch.zeros(tokens, dtype=torch.long, device=dev)
    results = []
    with torch.no_grad():
        side = torch.cuda.Stream(dev)  # warm up off the default stream (cuBLAS handles) before capturing
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                target(static)
                ahead.prefetch()
                ahead.wait()
                draft(static)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        ahead.wait()  # a cold start, outside the capture: the captured step skips layer 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_out = draft(static)
        captured_gathers = planner.gathers_this_step
        for r in range(replays):
            x = tokens_for(ctx.rank, r, [[tokens]], cfg.vocab, dev)
            static.copy_(x)
            target(x)
            ahead.prefetch()
            region()
            ahead.wait()
            graph.replay()
            torch.cuda.synchronize(dev)
            results.append(bool(torch.equal(static_out, draft_rep(x))))
    return {"rank": ctx.rank, "mode": comm_.mode, "region": label, "replays_equal": results,
            "gathers_in_captured_step": captured_gathers}
