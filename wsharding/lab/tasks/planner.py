"""Rank tasks that make the lookahead planner visible: traced steps of the decoder shaped like the
deployment of SGLang's weight sharding for Kimi K3, the slot/gate table of a real sharded model, and
the gate experiment.

They live in the package because spawned ranks import tasks by name; notebook 03, its widget and
the tests all call them through ``cluster.run``.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from wsharding.core.bound import raw_access
from wsharding.core.context import RankContext
from wsharding.core.errors import InvalidArgument
from wsharding.core.planner import ScheduleMissWarning
from wsharding.core.runner import aligned_forward, run_layers
from wsharding.core.schedule import GatherSchedule, ScheduledGather, lookahead_schedule, slot_name
from wsharding.core.sharding import WeightSharding
from wsharding.models import DecoderConfig, ToyDecoder, decoder_config


def _tokens_of(tokens: int | Sequence[int], rank: int) -> int:
    """``tokens`` is one count for every rank, or a list with one count per rank."""
    if isinstance(tokens, int):
        n = tokens
    else:
        if rank >= len(tokens):
            raise InvalidArgument(f"tokens: {len(tokens)} counts given, but rank {rank} needs one (one per rank)")
        n = tokens[rank]
    if n < 0:
        raise InvalidArgument(f"tokens: rank {rank} has a negative token count {n}")
    return n


def _sharded_model(ctx: RankContext, cfg: DecoderConfig, sharded_layers: Iterable[int] | None, lookahead: bool,
                   seed: int, group_size: int | None) -> ToyDecoder:
    """The sharded decoder on this rank, kept in ``ctx.store`` so that re-running the same
    configuration (the widget toggling lookahead) does not rebuild and re-finalize it."""
    layers = list(sharded_layers) if sharded_layers is not None else list(range(1, cfg.layers))
    g = group_size or ctx.world_size
    key = ("planner_tasks.model", cfg, tuple(layers), seed, g)
    model = ctx.store.get(key)
    if model is None:
        # Only one cached model at a time: a notebook that tries many configurations must not pile them up.
        for k in [k for k in ctx.store if isinstance(k, tuple) and k and k[0] == "planner_tasks.model"]:
            del ctx.store[k]
        comm = ctx.shard_comm(g)
        ws = WeightSharding(comm, sharded_layers=layers, lookahead=lookahead)
        model = ToyDecoder(cfg, seed=seed, weight_sharding=ws, device=comm.device).eval()
        ws.finalize()
        ctx.store[key] = model
    model.planner.lookahead = lookahead
    return model


def align_ranks(ctx: RankContext) -> None:
    """A barrier over every rank, so that the ranks start a traced step together: each rank's trace
    counts from its own step start, and a rank that started late would show the others' waiting
    for it as exposed gather time."""
    if not dist.is_initialized() or ctx.world_size == 1:
        return
    if ctx.backend == "nccl":  # ranks sharing a GPU meet over gloo, which takes no device ids
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()


def add_synthetic_compute(layers: Iterable[nn.Module], compute_ms: float) -> list[Any]:
    """Make every layer compute for at least ``compute_ms`` more: a forward hook that sleeps. Returns
    the hook handles (call ``.remove()`` on each).

    Why: on CPU ranks the toy decoder's layers compute for about as long as their gathers take,
    and two ranks share two cores with the notebook, so whether lookahead hides a gather is decided
    by noise. A fixed compute per layer, longer than a gather, stands in for a GPU layer and makes
    the effect lookahead has the same in every run. A sleep releases the GIL, so gloo's thread
    runs the gather meanwhile, as a GPU's side stream would."""
    if compute_ms < 0:
        raise InvalidArgument(f"compute_ms: must be >= 0, got {compute_ms}")
    if compute_ms == 0:
        return []
    seconds = compute_ms / 1e3

    def pause(_module: nn.Module, _args: Any, _out: Any) -> None:
        time.sleep(seconds)

    return [layer.register_forward_hook(pause) for layer in layers]


def trace_dense_layers(planner: Any, layers: Sequence[nn.Module], compute_ms: float = 0.0) -> list[Any]:
    """Forward hooks that mark the compute of every layer the planner does not shard (the dense
    layer 0) in the step's trace, as the planner marks its sharded layers: a timeline then draws
    layer 0 too, where it would otherwise show a blank compute lane before layer 1. Register after
    :func:`add_synthetic_compute`, so that the end mark comes after the added compute. Returns the
    hook handles."""
    handles = []
    for i, layer in enumerate(layers):
        if i in planner.slot_of:
            continue

        def start(_m: nn.Module, _args: Any, i: int = i) -> None:
            if planner.trace is not None:
                planner.trace.mark(i, "compute_start")

        def end(_m: nn.Module, _args: Any, _out: Any, i: int = i) -> None:
            if planner.trace is not None:
                planner.trace.mark(i, "compute_end")

        handles += [layer.register_forward_pre_hook(start), layer.register_forward_hook(end)]
    return handles


def traced_run(ctx: RankContext, preset: str | DecoderConfig, tokens: int | Sequence[int], lookahead: bool = True,
               steps: int = 2, *, layers: int | None = None, sharded_layers: Iterable[int] | None = None,
               seed: int = 0, group_size: int | None = None, compute_ms: float = 0.0) -> dict[str, Any]:
    """Run ``steps`` traced steps of the sharded decoder on this rank and report what happened.

    ``tokens``: tokens of this rank per step (one int for all ranks, or one per rank; 0 makes the
    rank idle: it runs the one-token dummy step so every rank issues the same gathers).
    ``layers`` overrides the preset's layer count; ``sharded_layers`` the sharded range (default:
    every layer but the dense layer 0). ``compute_ms`` adds a fixed compute to every layer
    (:func:`add_synthetic_compute`; 0: the decoder's own compute only). The ranks are aligned
    before each step (:func:`align_ranks`). Returns the per-layer trace records of every step (the
    dense layers' compute included: :func:`trace_dense_layers`), the gathers and waits counted by
    the planner per step, and the step wall times.
    """
    cfg = decoder_config(preset, layers)
    model = _sharded_model(ctx, cfg, sharded_layers, lookahead, seed, group_size)
    planner = model.planner
    n = _tokens_of(tokens, ctx.rank)
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    records: list[dict[str, Any]] = []
    gathers, waits, step_ms = [], [], []
    hooks = add_synthetic_compute(model.layers, compute_ms)
    hooks += trace_dense_layers(planner, model.layers)
    with torch.no_grad():
        planner.trace_enabled = True
        try:
            for _ in range(steps):
                x = torch.randint(0, cfg.vocab, (n,), generator=g).to(planner.device)
                align_ranks(ctx)
                t0 = time.perf_counter()
                aligned_forward(model, x, model.dummy_tokens)
                trace = planner.finish_step()
                step_ms.append((time.perf_counter() - t0) * 1e3)
                gathers.append(planner.gathers_this_step)
                waits.append(planner.waits_this_step)
                records += [dict(rec, lookahead=lookahead) for rec in trace.records()]
        finally:
            for h in hooks:
                h.remove()
            planner.trace_enabled = False
            planner.traces.clear()  # the records were copied out; keep nothing per step
    return {
        "rank": ctx.rank,
        "mode": planner.comm.mode,
        "emulation": ctx.emulation,
        "lookahead": lookahead,
        "tokens": n,
        "sharded_layers": model.weight_sharding.sharded_layer_ids,
        "gathers": gathers,
        "waits": waits,
        "step_ms": step_ms,
        "compute_ms": compute_ms,
        "records": records,
    }


def run_traced_steps(ctx: RankContext, preset: str | DecoderConfig, tokens: int | Sequence[int],
                     lookahead: bool = True, steps: int = 2, **kw: Any) -> list[dict[str, Any]]:
    """The trace records (``StepTrace.records()`` of every step, concatenated) of :func:`traced_run`."""
    return traced_run(ctx, preset, tokens, lookahead, steps, **kw)["records"]


def slot_table(ctx: RankContext, preset: str | DecoderConfig, *, layers: int | None = None,
               sharded_layers: Iterable[int] | None = None, group_size: int | None = None) -> list[dict[str, Any]]:
    """Per sharded layer of a real sharded decoder: its slot, the layer whose slot it overwrites
    (the gate) and its flat buffer size, read from the model's :class:`~wsharding.core.slots.SlotPool`."""
    cfg = decoder_config(preset, layers)
    model = _sharded_model(ctx, cfg, sharded_layers, True, 0, group_size)
    ws = model.weight_sharding
    pool = ws.slots
    return [
        {
            "layer": i,
            "slot": slot_name(pool.slot_of(i)),
            "gate": pool.previous_occupant(i),
            "layout_bytes": ws.layouts[i].total_bytes,
            "slot_bytes": pool.slot_bytes,
        }
        for i in ws.sharded_layer_ids
    ]


# ---- the gate experiment -------------------------------------------------------------------------
class ReadTwiceBlock(nn.Module):
    """Reads its weight, pauses, reads it again: a long compute that keeps using its slot. A gather
    that lands in the slot during the pause changes the second read, and so the output.

    Both reads go straight to the slot, as GPU kernels queued at the layer's start read it long after
    the host checked it: the check at use ([Note: checked at use] in ``wsharding/core/step_owner.py``)
    runs where the runner starts the block (``block_start``), and the forward runs under
    :data:`~wsharding.core.bound.raw_access`, so that the host-side guard of a direct read ([Note:
    reads of a bound weight] in ``wsharding/core/bound.py``) does not stand in for the GPU's order:
    inside a running layer only the gate keeps a gather out of its slot. Run it through
    :func:`~wsharding.core.runner.run_layers` (it is not checked when called on its own).

    ``between`` (optional) runs in the pause: the gate experiment uses it to let every gather in
    flight land there, so that the overwrite is certain rather than a matter of timing."""

    def __init__(self, d: int, seed: int, pause: float, between: Callable[[], None] | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(d, d, generator=g) / d**0.5)
        self.pause = pause
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with raw_access():
            h = nn.functional.linear(x, self.fc.weight)
            if self.pause:
                time.sleep(self.pause)
            if self.between is not None:
                self.between()
            return torch.tanh(h + nn.functional.linear(x, self.fc.weight))


class LandingComm:
    """A communicator that delegates everything to ``comm`` and remembers the gathers it started, so
    that :meth:`land_all` can block until every one of them has written its slot (CPU ranks).

    The gate experiment calls it between a layer's two reads: whatever the planner issued into that
    layer's slot has then certainly landed -- the race made certain, not timed."""

    def __init__(self, comm: Any) -> None:
        self.inner = comm
        self.in_flight: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prepare_gather(self, full: torch.Tensor, chunk: torch.Tensor, *, what: str = "") -> Any:
        return LandingGather(self.inner.prepare_gather(full, chunk, what=what), self.in_flight)

    def land_all(self) -> None:
        """Block until every gather started so far has completed."""
        while self.in_flight:
            self.in_flight.pop().wait()


class LandingGather:
    """A prepared gather that puts itself on its :class:`LandingComm`'s in-flight list when started."""

    def __init__(self, inner: Any, in_flight: list[Any]) -> None:
        self.inner = inner
        self.in_flight = in_flight

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start(self, gate: Any = None, marks: tuple | None = None, *, inline: bool = False) -> None:
        self.inner.start(gate, marks, inline=inline)
        self.in_flight.append(self.inner)

    def wait(self, stream: Any = None) -> None:
        self.inner.wait(stream)


def without_gates(schedule: GatherSchedule) -> GatherSchedule:
    """``schedule`` with every gather's gate removed: each is issued at its hook, whoever still reads its
    slot -- the race the gate prevents ([Note: the gate] in ``wsharding/core/planner.py``), shown."""
    def bare(gs: tuple[ScheduledGather, ...]) -> tuple[ScheduledGather, ...]:
        return tuple(dataclasses.replace(g, gate=None) for g in gs)

    return dataclasses.replace(schedule, at_step_start=bare(schedule.at_step_start),
                               at_block_start={b: bare(gs) for b, gs in schedule.at_block_start.items()},
                               at_block_end={b: bare(gs) for b, gs in schedule.at_block_end.items()})


def gate_experiment(ctx: RankContext, gate: bool, *, pause: float = 0.0, n_layers: int = 6, d: int = 32,
                    ahead: int = 2) -> dict[str, Any]:
    """A schedule ``ahead`` layers deep over two slots (the weight-sharding design gathers one ahead), so
    that the gather of layer ``i+2`` targets the slot layer ``i`` is reading, with its gates and with
    them removed (:func:`without_gates`).

    Between its two reads each layer waits until every gather in flight has landed (CPU ranks; see
    :class:`LandingComm`). With the gate the early gather is held until layer ``i`` is done (trace
    mark ``held``), nothing lands in its slot, and the output equals the unsharded blocks bit for
    bit; without it the gather has certainly overwritten the slot before the second read. Returns
    equality, gathers and the step's trace records.
    """
    if ahead < 1:
        raise InvalidArgument(f"ahead: must be >= 1, got {ahead}")
    comm = LandingComm(ctx.comm)
    blocks = [ReadTwiceBlock(d, seed=10 + i, pause=pause, between=comm.land_all) for i in range(n_layers)]
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        expected = x
        for b in blocks:  # unsharded reference, before sharding shrinks the weights
            expected = b(expected)
    ws = WeightSharding(comm, blocks, {i: ["fc"] for i in range(n_layers)}, trace=True).setup().finalize()
    planner = ws.planner
    # deeper than the two slots allow: each gather is issued while its slot's last reader still computes
    keep = (lambda s: s) if gate else without_gates
    planner.set_schedule(lambda sharded, slot_of, start, end: keep(lookahead_schedule(sharded, slot_of, ahead, start,
                                                                                      end)))
    # The planner's ScheduleMissWarning (a slot found without its layer at use) is part of what this
    # experiment shows: kept and returned, not written to the rank's stderr (a notebook would print it
    # in red, with the planner's file path, on every run).
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ScheduleMissWarning)
        h = run_layers(blocks, x, planner)
        trace = planner.finish_step()
    return {
        "rank": ctx.rank,
        "gate": gate,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, ScheduleMissWarning)],
        "equal": bool(torch.equal(h, expected)),
        "max_abs_diff": float((h - expected).abs().max()),
        "gathers": planner.gathers_this_step,
        "held_layers": sorted(r["layer"] for r in trace.records() if "held" in r),
        "records": trace.records(),
    }


def run_schedule(ctx: RankContext, n_layers: int = 6, d: int = 32, pause: float = 0.0,
                 lookahead: bool = True, steps: int = 1) -> list[dict[str, Any]]:
    """The design's layer loop (``run_layers``) over ``ReadTwiceBlock`` s, traced: a small model whose
    compute time is set by ``pause``, for a readable timeline. Each record says ``lookahead``
    (see :func:`wsharding.lab.viz.planner.exposed_span`)."""
    blocks = [ReadTwiceBlock(d, seed=10 + i, pause=pause) for i in range(n_layers)]
    ws = WeightSharding(ctx.comm, blocks, {i: ["fc"] for i in range(1, n_layers)}, lookahead=lookahead,
                        trace=True).setup().finalize()
    records = []
    with torch.no_grad():
        for s in range(steps):
            align_ranks(ctx)
            run_layers(blocks, torch.randn(2, d, generator=torch.Generator().manual_seed(s)), ws.planner)
            records += [dict(rec, lookahead=lookahead) for rec in ws.planner.finish_step().records()]
    return records


def model_schedule(n_layers: int = 6, gather_ms: float = 6.0, compute_ms: float = 10.0,
                   lookahead: bool = True, first_sharded: int = 1) -> list[dict[str, Any]]:
    """One step of the planner's order with fixed durations, as trace records (times in µs): no
    ranks, no clock, the same picture every time -- the opening figure of the series.

    The order is the planner's (notebook 03 §2): layer ``first_sharded``'s gather is issued before
    layer 0 runs (``begin_step``); with lookahead the gather of layer ``l+1`` is issued as layer
    ``l`` starts, into slot A or B by parity, and not before the previous reader of that slot,
    layer ``l-1``, has finished (the gate) nor before the previous gather (one side stream); each layer waits for its own gather, then computes for
    ``compute_ms``. Without lookahead each gather is issued at its layer's start. The dense layers
    before ``first_sharded`` get a record too (compute only, ``slot`` None), so that a figure draws
    every layer of the step. A live run (:func:`run_schedule`) has the same order with measured times."""
    if n_layers < first_sharded + 1 or first_sharded < 0:
        raise InvalidArgument(f"model_schedule: need 0 <= first_sharded < n_layers, got {first_sharded}, {n_layers}")
    if gather_ms <= 0 or compute_ms <= 0:
        raise InvalidArgument(f"model_schedule: durations must be > 0, got gather {gather_ms}, compute {compute_ms}")
    g, c = gather_ms * 1e3, compute_ms * 1e3
    records: dict[int, dict[str, Any]] = {}
    gather_end: dict[int, float] = {}
    compute_end: dict[int, float] = {}

    def issue(layer: int, at: float) -> None:
        slot = slot_name((layer - first_sharded) % 2)
        reader = layer - 2  # the previous occupant of the slot
        gate = compute_end.get(reader, 0.0) if reader >= first_sharded else 0.0
        start = max(at, gate, max(gather_end.values(), default=0.0))  # one side stream: gathers run in order
        rec = records.setdefault(layer, {"step": 0, "rank": 0, "layer": layer, "slot": slot, "lookahead": lookahead})
        rec.update(issue=at, gather_start=start, gather_end=start + g)
        if gate > at:
            rec["held"] = at  # held by the gate, as the planner marks it
        gather_end[layer] = start + g

    t = 0.0
    if lookahead:
        issue(first_sharded, 0.0)
    for layer in range(n_layers):
        if lookahead and layer + 1 < n_layers and layer + 1 > first_sharded:
            issue(layer + 1, t)
        if layer >= first_sharded:
            if layer not in gather_end:
                issue(layer, t)
            rec = records[layer]
            rec["wait_start"] = t
            t = max(t, gather_end[layer])
            rec["wait_end"] = rec["compute_start"] = t
        if layer < first_sharded:  # a dense layer: computed, never gathered (drawn all the same)
            records[layer] = {"step": 0, "rank": 0, "layer": layer, "slot": None, "lookahead": lookahead,
                              "compute_start": t, "compute_end": t + c}
        t += c
        compute_end[layer] = t
        if layer >= first_sharded:
            records[layer]["compute_end"] = t
    return [records[k] for k in sorted(records)]


def describe_sharding(ctx: RankContext, preset: str | DecoderConfig, *, layers: int | None = None,
                      sharded_layers: Iterable[int] | None = None, group_size: int | None = None) -> dict[str, Any]:
    """What sharding did to the decoder on this rank: per layer its targets, layout and slot
    (``WeightSharding.describe()``), the layouts themselves, and the bytes -- R, the formula and
    the resident bytes measured from the storages."""
    cfg = decoder_config(preset, layers)
    model = _sharded_model(ctx, cfg, sharded_layers, True, 0, group_size)
    ws = model.weight_sharding
    return {
        "rank": ctx.rank,
        "mode": ws.comm.mode,
        "emulation": ctx.emulation,
        "describe": ws.describe(),
        "layouts": [ws.layouts[i] for i in ws.sharded_layer_ids],
        "skipped": list(ws.skipped),
        "replicated_bytes": ws.replicated_bytes(),
        "formula_bytes": ws.formula_bytes(),
        "resident_bytes": ws.resident_bytes(),
        "slot_bytes": ws.slots.slot_bytes,
    }
