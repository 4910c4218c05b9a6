"""Running a sharded model: the weight-sharding design's layer loop, the generic path's wrappers, and
idle ranks.

* :func:`run_layers` -- the layer loop of SGLang's weight sharding for Kimi K3 with the planner wired in
  (begin the step, then per layer: join its gather and issue the schedule's next, run the layer,
  record its end; end the step, also when a layer raised), and
  :func:`prepare_layer_weight_shard_forward`, which a sharded layer calls at its start.
* :func:`shard_blocks` -- the generic path, for a model that is not ours: the same sequence put
  around the model's blocks (a hook on the model, a wrapped ``forward`` on each block), so the
  model's own code stays unchanged.
* :func:`aligned_forward` -- every rank of a shard group must issue the same gathers every step: a
  rank with no tokens runs a one-token dummy step instead of skipping.

What a :class:`~wsharding.core.sharding.WeightSharding` *is* (declare, validate, shrink, finalize, close)
lives in ``sharding.py``; this module only runs it.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from wsharding.core import graph_ops
from wsharding.core.comm import Communicator
from wsharding.core.contract import ParallelLinear
from wsharding.core.declare import UnmatchedPatternWarning, close_names
from wsharding.core.graph_ops import compiled_block, register_planner
from wsharding.core.options import ShardingOptions, layer_indices
from wsharding.core.planner import WeightShardPlanner
from wsharding.core.plugins import PlannerPlugin
from wsharding.core.sharding import ShardingError, WeightSharding, abandon_sharding
from wsharding.core.step_owner import StepOwner


def prepare_layer_weight_shard_forward(layer: nn.Module) -> None:
    """Called at the start of a sharded layer's forward: wait (once) until its weights are in its
    slot. A layer that is not sharded returns at once."""
    ws = getattr(layer, "_weight_shard", None)
    if ws is not None:
        planner, layer_id = ws
        planner.ensure(layer_id)


def run_layers(
    layers: Sequence[nn.Module],
    hidden: Any,
    planner: StepOwner | None,
    start_layer: int = 0,
    end_layer: int | None = None,
    call: Callable[[nn.Module, Any], Any] | None = None,
) -> Any:
    """The weight-sharding design's layer loop with the planner wired in (``planner=None``: plain replicated loop)."""
    end = len(layers) if end_layer is None else end_layer
    call = call or (lambda layer, h: layer(h))
    if planner is None:
        for i in range(start_layer, end):
            hidden = call(layers[i], hidden)
        return hidden
    planner.begin_step(start_layer, end)
    try:
        for i in range(start_layer, end):
            planner.block_start(i)  # its own gather joined (checked); the schedule's next ones issued
            hidden = call(layers[i], hidden)
            planner.block_end(i)  # its end recorded: a gate
    except BaseException:
        planner.abort_step()  # the peers' gathers of this step still issued and joined
        raise
    planner.end_step()
    return hidden


# ---- the generic path: any nn.Module whose blocks sit in a ModuleList ------------------------------
def _is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, (nn.Linear, ParallelLinear))


def find_targets(block: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Names of the linear submodules (``nn.Linear`` or wsharding linears) of ``block`` that match
    any of ``patterns`` (fnmatch)."""
    return [
        name
        for name, mod in block.named_modules()
        if name and _is_linear(mod) and any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def warn_unmatched_patterns(blocks: nn.ModuleList, patterns: Sequence[str], targets: dict[int, list[str]],
                            rank: int) -> None:
    """Warn (:class:`~wsharding.core.declare.UnmatchedPatternWarning`, rank 0 only) about every pattern
    that matched no linear in any block, naming the linears nearest to it.

    Why: such a pattern shards nothing and says nothing -- ``"mlp.fc_2"`` for ``"mlp.fc2"`` keeps that
    weight whole on every rank, and the saving the user counted on is silently not there. Every rank
    sees the same patterns and blocks, so rank 0 alone says it (as the declare stage's skip warning)."""
    matched = {n for names in targets.values() for n in names}
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in matched)]
    if not unmatched or rank != 0:
        return
    linears = sorted({n for b in blocks for n, m in b.named_modules() if n and _is_linear(m)})
    for p in unmatched:
        others = sorted({n for b in blocks for n, m in b.named_modules() if n and fnmatch.fnmatchcase(n, p)})
        if others:
            why = (f"it matches {', '.join(map(repr, others[:3]))}, not a linear (targets are nn.Linear or "
                   "wsharding linears): name the linears inside it, e.g. " + repr(f"{others[0]}.*"))
        else:
            listed = ", ".join(map(repr, linears[:6])) + (" ..." if len(linears) > 6 else "") or "none"
            near = close_names(p, linears) or f" (the blocks' linears: {listed})"
            why = f"no submodule has that name{near}; fix the pattern or leave it out"
        warnings.warn(f"patterns: {p!r} matches no linear in any of the {len(blocks)} blocks, so it shards nothing "
                      f"and those weights stay whole on every rank: {why}", UnmatchedPatternWarning, stacklevel=3)


#: What a communicator has for sure (the :class:`~wsharding.core.comm.Communicator` protocol): an
#: object without these is something else passed by mistake (None, a backend name, a RankContext).
_COMM_ATTRIBUTES = ("rank", "world_size", "device", "all_gather_into")


def check_shard_blocks_args(
    model: nn.Module, blocks: str | nn.ModuleList, patterns: Sequence[str], comm: Communicator,
    sharded_layers: Iterable[int] | None,
) -> tuple[nn.ModuleList, list[str], list[int] | None]:
    """The arguments of :func:`shard_blocks` (and :func:`wsharding.checkpoint.load_sharded`), checked
    before anything is touched; returns the blocks, the patterns and the layer indices as lists.

    Each mistake here would otherwise be read some other way: a str of patterns character by
    character (``"fc*"`` holds ``"*"``, which shards every linear), a float layer index as no layer,
    a generator of patterns as empty after the first block -- or end in an AttributeError far from
    the cause (``comm=None``) or a message holding the repr of every block (a list of blocks).
    """
    if not isinstance(model, nn.Module):
        raise ShardingError(f"model: a {type(model).__name__} is not an nn.Module; pass the model whose blocks are "
                            "sharded")
    if isinstance(blocks, str):
        try:
            block_list = model.get_submodule(blocks)
        except AttributeError:
            lists = [n for n, m in model.named_modules() if n and isinstance(m, nn.ModuleList)]
            known = f" (its ModuleLists: {', '.join(map(repr, lists[:5]))})" if lists else " (it has no nn.ModuleList)"
            raise ShardingError(f"blocks: {type(model).__name__} has no submodule {blocks!r}{known}; name the "
                                "nn.ModuleList of blocks by its attribute path, e.g. 'model.layers'") from None
        if not isinstance(block_list, nn.ModuleList):
            raise ShardingError(f"{blocks!r} is a {type(block_list).__name__}, expected the nn.ModuleList of blocks")
    elif isinstance(blocks, nn.ModuleList):
        block_list = blocks
    else:
        size = f" of {len(blocks)} modules" if isinstance(blocks, (list, tuple)) else ""
        raise ShardingError(f"blocks: got a {type(blocks).__name__}{size}; pass the nn.ModuleList itself (e.g. "
                            "model.layers) or its attribute name as a str (e.g. 'layers')")
    if isinstance(patterns, (str, bytes)):
        raise ShardingError(f"patterns: got the str {patterns!r}, which would be read character by character; pass "
                            f"a list of patterns: [{patterns!r}]")
    pattern_list = list(patterns)
    odd = [p for p in pattern_list if not isinstance(p, str)]
    if odd:
        raise ShardingError(f"patterns: {odd[0]!r} (of type {type(odd[0]).__name__}) is not a str; every pattern "
                            "is a str of fnmatch syntax, e.g. ['attn.*_proj', 'mlp.fc1']")
    missing = [a for a in _COMM_ATTRIBUTES if not hasattr(comm, a)]
    if missing:
        if hasattr(comm, "shard_comm"):
            raise ShardingError(f"comm: got a {type(comm).__name__}, the rank's context, not a communicator; pass "
                                "ctx.shard_comm(group_size) (or ctx.comm for the whole world)")
        got = "None" if comm is None else f"the str {comm!r}" if isinstance(comm, str) else \
            f"a {type(comm).__name__} (it has no {', '.join(missing)})"
        raise ShardingError(f"comm: got {got}, not a communicator; pass the communicator of the shard group: "
                            "ctx.shard_comm(group_size), with ctx = wsharding.init_from_env() in a torchrun "
                            "launch, or the context a RankCluster task receives")
    return block_list, pattern_list, layer_indices(sharded_layers)


def refuse_blocks_off_device(block_list: nn.ModuleList, sharded_layers: list[int] | None, comm: Communicator) -> None:
    """Every parameter of a sharded block on the communicator's device (meta ones aside: they are loaded
    there). The block computes with the weights gathered on that device; a parameter elsewhere -- a
    model built on the CPU beside a GPU communicator -- would meet them in the block's first forward
    as torch's device error, after the sharding and far from its cause."""
    dev = torch.device(comm.device)
    for i, block in enumerate(block_list):
        if sharded_layers is not None and i not in sharded_layers:
            continue
        for name, p in block.named_parameters():
            if p.is_meta or (p.device.type == dev.type and (dev.index is None or p.device.index == dev.index)):
                continue
            raise ShardingError(f"rank {comm.rank}: block {i}'s {name} is on {p.device}, but the communicator gathers "
                                f"on {dev}: the block would compute with weights on both. Build or move the model to "
                                f"{dev} before sharding (model.to(ctx.device)), or shard over a communicator on "
                                f"{p.device}")


def shard_blocks(
    model: nn.Module,
    blocks: str | nn.ModuleList,
    patterns: Sequence[str],
    comm: Communicator,
    *,
    sharded_layers: Iterable[int] | None = None,
    lookahead: bool = True,
    trace: bool = False,
    keep_initial_weights: bool = True,
    load: Callable[[WeightSharding], Any] | None = None,
    plugins: Sequence[PlannerPlugin] = (),
    map_own_chunk: bool | Literal["auto"] = "auto",
    prefetch_depth: int = 1,
    on_miss: Literal["gather", "raise"] = "gather",
    verify_replicas: bool = True,
) -> WeightSharding:
    """Shard the ``nn.Linear`` weights matching ``patterns`` in each block of ``model.<blocks>``.

    Matching package linears are decided by their group: those split by tensor parallelism are left
    alone, each with its reason in ``ws.report()``.

    ``plugins``: planner plug-ins, e.g. ``[NextStepPrefetch()]`` (:mod:`wsharding.core.next_step`):
    each step issues the next step's first gather while its own last blocks run.

    ``map_own_chunk``: no gather copies the rank's own chunk -- each block gathers into a range mapped
    over it ([Note: the own chunk mapped, not copied] in ``wsharding/accel/mapped_slots.py``; our NCCL
    communicator, NCCL >= 2.30). ``"auto"`` (the default) maps where it can run and holds no more;
    ``ws.map_own_chunk_reason`` says which ([Note: map_own_chunk="auto"]).

    ``prefetch_depth``: gathers in flight ahead of the computing block (``k``; ``k + 1`` slots, resident
    ``R/N + (k+1) max|T_l|``). ``on_miss``: what a block does when its slot does not hold its weights
    (called out of order, on its own, after a peer failed): ``"gather"`` them now and warn once, or
    ``"raise"`` ([Note: checked at use] in ``wsharding/core/step_owner.py``).

    ``verify_replicas``: finalize refuses ranks whose weights, kept as built, differ (no common seed),
    naming the first such weight on every rank; False skips the check (:class:`WeightSharding`).

    ``load(ws)``, when given, runs between setup and finalize -- the moment to read a checkpoint
    row range by row range (:func:`wsharding.checkpoint.load_sharded` wires it up).

    The model's own code is unchanged: hooks on the model start each step (reset, pre_dispatch) and
    a wrapper around each block's ``forward`` dispatches the next block's gather, waits for the
    block's own, and records its end ([Note: one wrapper per block, not two hooks]). Returns the
    finalized :class:`WeightSharding` (``.planner`` has the counters and trace).
    """
    block_list, patterns, sharded_layers = check_shard_blocks_args(model, blocks, patterns, comm, sharded_layers)
    options = ShardingOptions(sharded_layers, lookahead, trace, keep_initial_weights, plugins, map_own_chunk,
                              prefetch_depth, on_miss, verify_replicas)
    try:
        refuse_blocks_off_device(block_list, sharded_layers, comm)
        targets = {i: find_targets(b, patterns) for i, b in enumerate(block_list)}
        warn_unmatched_patterns(block_list, patterns, targets, comm.rank)
        ws = WeightSharding(comm, block_list, targets, options=options)
        ws.refuse_tied_to(model)  # a head or embedding tied to a target: only the whole model shows it
        ws.setup()
        if load is not None:
            ws.load_result = load(ws)
    except Exception as e:
        # This rank stops before finalize, where its peers wait for it: they learn it in finalize's
        # agreement and raise too, instead of waiting in a gather until the collective timeout (a
        # checkpoint unreadable on one node, a tie only one rank's model has).
        abandon_sharding(comm, f"rank {comm.rank} stopped before finalize: {type(e).__name__}: {e}")
        raise
    ws.finalize()
    planner = ws.planner
    count = len(block_list)

    handles: list[Any] = [model.register_forward_pre_hook(StepStart(planner, count)),
                          # always_call: a forward that raised between blocks still ends its step
                          model.register_forward_hook(StepEnd(planner), always_call=True)]
    handles += [PlannedBlockForward(b, i, planner) for i, b in enumerate(block_list)]
    ws.hook_handles = handles
    return ws


class StepStart:
    """The model's forward pre-hook: a step over every block begins. A class, not a closure, so that
    pickling a sharded model reaches the guard that refuses it instead of a local function."""

    def __init__(self, planner: WeightShardPlanner, count: int) -> None:
        self.planner, self.count = planner, count

    def __call__(self, _mod: nn.Module, _args: Any) -> None:
        self.planner.begin_step(0, self.count)


class StepEnd:
    """The model's forward hook (always called): the step ends, and its trace is closed."""

    def __init__(self, planner: WeightShardPlanner) -> None:
        self.planner = planner

    def __call__(self, _mod: nn.Module, _args: Any, _out: Any) -> None:
        self.planner.finish_step()


class PlannedBlockForward:
    """A block's ``forward`` wrapped in the planner's per-layer calls; ``remove()`` undoes it, like a
    hook's handle.

    [Note: one wrapper per block, not two hooks]
    Module hooks would do the same, but any hook sends ``nn.Module.__call__`` down its slow path (hook
    lists built, global hooks checked, a closure per call): two no-op hooks cost a block 3.6 us of host
    on a workstation CPU and more on the GPU host, about as much as the planner's whole work for the
    layer. A ``forward`` set on the instance keeps the fast path and costs one Python call. The
    sequence is the hooks' (join this block's gather and issue the schedule's next, run, record the
    end; a block that raises gives up the step), and a block called through ``block.forward(...)``
    goes through the planner too.
    """

    def __init__(self, block: nn.Module, layer: int, planner: WeightShardPlanner) -> None:
        self.block = block
        #: An earlier instance-level forward (someone else's wrapper) is kept and called, then restored.
        self.previous = block.__dict__.get("forward")
        self.active = True
        inner = block.forward  # the bound method of the class, or the earlier wrapper

        key = register_planner(planner)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.active:  # removed while someone else's wrapper sat on top of ours
                return inner(*args, **kwargs)
            if graph_ops.enabled and torch.compiler.is_compiling():
                return compiled_block(inner, key, layer, args, kwargs)
            planner.block_start(layer)
            try:
                out = inner(*args, **kwargs)
            except BaseException:
                planner.abort_step()
                raise
            planner.block_end(layer)
            return out

        self.forward = forward
        block.forward = forward

    def remove(self) -> None:
        self.active = False
        if self.block.__dict__.get("forward") is self.forward:  # still on top: put back what was there
            if self.previous is None:
                del self.block.forward
            else:
                self.block.forward = self.previous


# ---- collective alignment --------------------------------------------------------------------------
def aligned_forward(forward: Callable[[Any], Any], inputs: Any, dummy: Callable[[], Any]) -> Any | None:
    """Run ``forward(inputs)``; when this rank has no tokens (``inputs`` is None or empty), run a
    one-token ``dummy()`` forward instead and return None.

    Why: every rank of a shard group must issue the same gathers every step. An idle DP rank that
    skipped the forward would leave the others waiting in the gather of the first sharded layer.
    """
    empty = inputs is None or (isinstance(inputs, torch.Tensor) and inputs.numel() == 0)
    if empty:
        forward(dummy())
        return None
    return forward(inputs)
