"""Run a serving step eagerly, or replay it from a CUDA graph captured for its shape, and time one.

A server does not pay the host for every kernel of a decode step: vLLM captures the step of each of a
few batch sizes in a CUDA graph and replays it, mixed prefill steps run eagerly. :class:`StepRunner`
does the same for ``ToyDecoder.forward_serve``: each captured shape
(:attr:`~wsharding.models.serve_step.ServeStep.shape`: the token bucket and the attention groups) has
its static input step (:func:`~wsharding.serve.step.padding_step`), a graph and a static output; a
decode-only step of a captured shape is copied into the static inputs and replayed, any other step
runs eagerly. Graph and eager run the same kernels on the same shapes, so the tokens are the same
([Note: bits across buckets] in :mod:`wsharding.serve.step`). The runner counts both kinds of step.

Which shapes: the groups make shapes many (a count per context bucket present), so the runner
captures the shapes it is given, not every shape it meets. A sharded model's step holds its
gathers, and capturing a collective is collective ([Note: a gather launched as a graph] in
``wsharding/accel/captured_launch.py``): the warm-up runs before each capture gather with the other
ranks, so every rank captures the same shapes in the same order (:meth:`StepRunner.capture`;
:func:`shapes_of_every_rank` merges what each rank met). At serving time a rank may replay a graph
while another runs its step eagerly: each still runs one gather per sharded layer per step, in layer
order, and an eager gather is itself the launch of a captured graph ([Note: a gather launched as a
graph]), so the gathers pair as between eager steps -- what the runner's GPU test checks.
The replicated model holds no collective, but is given the same shapes, so that both variants run
the same steps from graphs.

A benchmark serves a **pair** (:func:`pair_eager_reason`): the replicated and the sharded model both
replay graphs, or both run every step eagerly -- a pair with graphs on one side only would time the
host's launch cost against no launch cost, not sharding against replication.

Where the runner stays eager, it says why (:attr:`StepRunner.eager_reason`): CPU ranks, or graphs
turned off. Graphs asked for on a GPU whose sharded model's communicator cannot capture its gathers
(:func:`wsharding.comm_by_name.graph_unsupported`) are refused with the reason, not run eagerly unsaid.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.comm_by_name import graph_unsupported
from wsharding.core.errors import InvalidArgument, Unsupported
from wsharding.cuda_graph import capture_graph
from wsharding.models.serve_step import ServeStep
from wsharding.serve.blocks import BlockPool
from wsharding.serve.step import BuiltStep, build_step, padding_step

#: A step's shape: ``(rows, ((entries, length, width) per group))`` (:attr:`ServeStep.shape`).
Shape = tuple[int, tuple[tuple[int, int, int], ...]]

#: Why a shared GPU is refused unless asked for (:class:`StepRunner`'s ``shared_gpu``).
SHARED_GPU = "several ranks share one GPU"


def decode_shapes(token_sizes: list[int], context_sizes: list[int], max_tokens: int | None = None) -> list[Shape]:
    """The decode-only shapes of one group: ``n`` decodes of one context bucket (``rows`` = the token
    bucket of ``n``, one group of as many entries), for every token bucket up to ``max_tokens`` and
    every context bucket. A step whose sequences sit in several buckets has another shape."""
    return [(n, ((n, 1, w),)) for n in token_sizes if max_tokens is None or n <= max_tokens for w in context_sizes]


def graph_refusal(model: Any, device: torch.device, shared_gpu: bool = False) -> str | None:
    """Why ``model``'s serving steps on ``device`` cannot be captured in CUDA graphs, or None: CPU
    ranks; a sharded model whose communicator's gathers cannot be captured
    (:func:`~wsharding.comm_by_name.graph_unsupported`; ranks sharing one GPU only without ``shared_gpu``)."""
    if torch.device(device).type != "cuda":
        return "CUDA graphs need a GPU (these are CPU ranks): every step runs eagerly"
    ws = getattr(model, "weight_sharding", None)
    if ws is None:
        return None  # no gather in the step
    why = graph_unsupported(ws.comm)
    if why is not None and not (shared_gpu and why.startswith(SHARED_GPU)):
        return why
    return None


#: ``bench serve --graphs``: ``auto`` replays graphs where :func:`pair_eager_reason` finds none refused.
GRAPH_MODES = ("auto", "on", "off")


def pair_eager_reason(mode: str, comm: Any) -> str | None:
    """Why both variants of a pair served over ``comm`` (the sharded variant's communicator) run every
    step eagerly, or None when both replay graphs; ``mode`` one of :data:`GRAPH_MODES`. The replicated
    model captures wherever there is CUDA, the sharded one only where its gathers can be captured
    (:func:`~wsharding.comm_by_name.graph_unsupported`; ranks sharing one GPU are refused, no opt-in):
    either refused, both run eagerly, so that the pair stays fair. ``on`` where they cannot is refused
    (:class:`~wsharding.core.errors.Unsupported`, the reason said), before anything is served."""
    if mode not in GRAPH_MODES:
        raise InvalidArgument(f"graphs: one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == "off":
        return "turned off: both variants run every step eagerly"
    why = graph_unsupported(comm)
    if why is None:
        return None
    if mode == "on":
        raise Unsupported(f"--graphs on: the sharded variant's steps cannot be captured in CUDA graphs here: {why}; "
                          "pass --graphs auto (both variants then run eagerly, said in the report) or --graphs off")
    return f"both variants run every step eagerly: the sharded variant's steps cannot be captured here ({why})"


@dataclass
class _Graph:
    static: ServeStep
    graph: Any
    out: torch.Tensor


class StepRunner:
    """``runner(built) -> logits``: a built step (:func:`~wsharding.serve.step.build_step`) run by
    ``model.forward_serve``, or replayed from the graph of its shape when one was captured
    (:meth:`capture`). The logits returned are the step's own (a copy when replayed).

    ``graphs``: False runs every step eagerly (the same runner, to compare); on a GPU whose sharded
    model's gathers cannot be captured, True is refused (:func:`graph_refusal` says why); on CPU ranks
    the runner is eager and says so (:attr:`eager_reason`). ``shared_gpu``: capture
    even where several ranks share one GPU, which :func:`~wsharding.comm_by_name.graph_unsupported`
    refuses (an early probe of a captured gather hung there; the draft model's captured gather has
    passed there since, with NCCL 2.32) -- an opt-in until a run of this runner has passed there.
    """

    def __init__(self, model: Any, pool: BlockPool, *, graphs: bool = True, shared_gpu: bool = False) -> None:
        self.model = model
        self.pool = pool
        device = pool.device
        why = graph_refusal(model, device, shared_gpu) if graphs else "graphs turned off"
        if why is not None and device.type == "cuda" and graphs:
            raise Unsupported(f"StepRunner: the serving steps cannot be captured in CUDA graphs: {why}; pass "
                              "graphs=False to run every step eagerly")
        #: None where the runner replays graphs; else why every step runs eagerly.
        self.eager_reason: str | None = why
        self.graphed_steps = 0
        self.eager_steps = 0
        #: Seconds spent in :meth:`capture` (warm-ups included), to the device's end.
        self.capture_s = 0.0
        #: Decode-only shapes met and run eagerly (no graph of theirs): what a later capture could take.
        self.missed: Counter[Shape] = Counter()
        self._graphs: dict[Shape, _Graph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if why is None else None

    @property
    def captured(self) -> list[Shape]:
        """The shapes that have a graph, in capture order."""
        return list(self._graphs)

    def counts(self) -> dict[str, Any]:
        """What a report keeps: steps replayed and run eagerly, the graphs, and why none where none."""
        return {"graphed_steps": self.graphed_steps, "eager_steps": self.eager_steps, "graphs": len(self._graphs),
                "capture_s": self.capture_s, "eager_reason": self.eager_reason}

    def capture(self, shapes: list[Shape], *, warmup: int = 2) -> int:
        """Capture a graph for each decode-only shape of ``shapes`` not captured yet; returns how many
        were captured. Collective for a sharded model: every rank calls it with the same shapes in the
        same order (each warm-up step gathers). Where the runner is eager, it captures nothing and
        returns 0 (:attr:`eager_reason` says why). Run it between runs, not inside one: each capture's
        warm-up steps write only the scratch block, but they are steps of the sharded model's planner."""
        for shape in shapes:  # every shape checked before any capture: every rank refuses at once
            if any(length != 1 for _, length, _ in shape[1]):
                raise InvalidArgument(f"StepRunner.capture: {shape} has a prefill chunk group (length > 1); graphs "
                                      "are captured for decode-only steps, mixed steps run eagerly")
        if self.eager_reason is not None:
            return 0
        done = 0
        t0 = time.perf_counter()
        for shape in shapes:
            if shape in self._graphs:
                continue
            static = padding_step(self.pool, shape)
            with torch.no_grad():
                graph, out = capture_graph(lambda static=static: self.model.forward_serve(static), self.pool.device,
                                           warmup=warmup, pool=self._mempool)
            self._graphs[shape] = _Graph(static, graph, out)
            done += 1
        torch.cuda.synchronize(self.pool.device)
        self.capture_s += time.perf_counter() - t0
        return done

    def close(self) -> None:
        """Drop every graph (after the device has run them). A sharded model's graphs hold its
        communicator's collectives, and NCCL's destroy waits for every graph that does: close the
        runner (or let it go) before the communicator is closed."""
        if self._graphs:
            torch.cuda.synchronize(self.pool.device)
        self._graphs.clear()

    def __call__(self, built: BuiltStep | ServeStep) -> torch.Tensor:
        step = built.step if isinstance(built, BuiltStep) else built
        shape = step.shape
        g = self._graphs.get(shape)
        if g is None:
            self.eager_steps += 1
            if step.decode_only:
                self.missed[shape] += 1
            return self.model.forward_serve(step)
        g.static.copy_(step)
        g.graph.replay()
        self.graphed_steps += 1
        return g.out.clone()  # the next replay of this shape overwrites the static output


def shapes_of_every_rank(shapes: list[Shape], group: Any = None) -> list[Shape]:
    """The union of every rank's ``shapes``, in one order on every rank (sorted): what each rank then
    passes to :meth:`StepRunner.capture`. Collective over ``group`` (torch.distributed; a single
    process: ``shapes`` sorted)."""
    import torch.distributed as dist

    mine = sorted(set(shapes))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return mine
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return sorted({_as_shape(s) for rank in every for s in rank})


def _as_shape(s: Any) -> Shape:
    rows, groups = s
    return int(rows), tuple((int(e), int(n), int(w)) for e, n, w in groups)


def time_step(model: Any, tokens: int, width: int, *, graph: bool = False, runs: int = 10, warmup: int = 3,
              pool: BlockPool | None = None, shared_gpu: bool = False) -> float:
    """Microseconds of one bucketed decode step of ``tokens`` rows each attending over ``width``
    pool rows: the median of ``runs`` steps after ``warmup`` untimed ones, each from its start to the
    device's end (synchronized: a server's host reads the tokens every step). Eager, or with ``graph``
    replayed from a CUDA graph of its shape (refused where :class:`StepRunner` cannot capture).

    The step is padding (:func:`~wsharding.serve.step.build_step` of no request with one token bucket
    and one context bucket): every row a decode entry reading the scratch block ``width`` wide, so it
    costs what a decode step of its shape costs, whichever sequences the pool holds. A sharded model's
    step gathers: every rank calls this with the same arguments at the same time."""
    if tokens < 1 or width < 1 or runs < 1 or warmup < 0:
        raise InvalidArgument(f"time_step: tokens, width and runs >= 1 and warmup >= 0, got tokens={tokens}, "
                              f"width={width}, runs={runs}, warmup={warmup}")
    from wsharding.serve.blocks import BLOCK_TOKENS, blocks_for

    width = blocks_for(width) * BLOCK_TOKENS
    pool = pool if pool is not None else BlockPool.for_model(model, 1)
    built = build_step(pool, [], [tokens], [width])
    if graph:
        why = graph_refusal(model, pool.device, shared_gpu)
        if why is not None:
            raise Unsupported(f"time_step: no graph here: {why}; time it eagerly (graph=False)")
    runner = StepRunner(model, pool, graphs=graph, shared_gpu=shared_gpu)
    if graph:
        runner.capture([built.step.shape])
    device = pool.device
    times = []
    try:
        with torch.no_grad():
            for i in range(warmup + runs):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                runner(built)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e6)
    finally:
        runner.close()
    if graph and runner.graphed_steps != warmup + runs:
        raise Unsupported(f"time_step: {runner.graphed_steps} of {warmup + runs} steps replayed the graph")
    return statistics.median(times)
