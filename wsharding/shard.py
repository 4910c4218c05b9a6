"""Sharding a model's replicated weights: declare, validate, shrink, load rows, finalize, bind.

A sharded weight goes through four stages (first seed, "SGLang 中的实现"):

1. **declare / validate** (:class:`WeightSharding` constructor): each layer names its candidates.
   The package's own linears are decided by their group (the second seed's Linear contract): tp size
   1 (byte-identical on every rank) -> a target, tp size > 1 -> left alone, as the seed shards
   attention only when attn_tp_size == 1 and MoE peripherals only when replicated; every decision and
   its reason is kept (:meth:`WeightSharding.report`). Any other module with ``tp_size`` > 1 is an
   error naming it; a weight whose rows the group size does not divide is skipped with a warning. The
   layer's targets form one :class:`~wsharding.layout.FlatLayout` -- one gather per layer. Every
   decision that needs the full shape is taken here, before anything shrinks.
2. **setup** (:meth:`WeightSharding.setup`): each target keeps only its own 1/N rows; a row-shard
   loader replaces the parameter's weight loader so that a checkpoint is read row range by row range
   (merged linears: per sub-block, :meth:`row_sub_blocks`).
3. **finalize** (:meth:`WeightSharding.finalize`): the row shards are redistributed into the flat
   chunks -- per weight one plain gather (the seed's temporary full weight; here it lands in slot B,
   so nothing extra is allocated), of which each rank keeps the bytes inside its own chunk window;
   the row shards are then freed and every target's weight becomes a zero-copy view of its slot.
4. **forward**: the planner gathers each layer's chunk into its slot just in time.
"""

from __future__ import annotations

import fnmatch
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from wsharding.comm.base import Communicator
from wsharding.layout import FlatLayout
from wsharding.linear.base import LinearBase, rebind_tensor
from wsharding.planner import ShardedLayer, WeightShardPlanner
from wsharding.slots import SlotPool
from wsharding.units import align_up

#: How many shardings were finalized on each communicator: numbers the window tags of the next one.
_SHARDINGS_ON: weakref.WeakKeyDictionary[Communicator, int] = weakref.WeakKeyDictionary()

#: (shard_id, param_row_offset, rows_in_param, checkpoint_row_offset)
RowBlock = tuple[Any, int, int, int]


class ShardingError(ValueError):
    """A target that cannot be sharded, or a sharding used out of order."""


class ShardingSkipWarning(UserWarning):
    """A declared target left replicated (its rows are not divisible by the group size)."""


@dataclass
class ShardTarget:
    """One weight that is stored 1/N per rank and gathered before its layer runs."""

    layer: int
    name: str  # attribute path inside the layer, e.g. "attn.qkv_proj"
    module: nn.Module
    shape: tuple[int, ...]
    dtype: torch.dtype
    row_blocks: list[RowBlock] = field(default_factory=list)

    @property
    def entry(self) -> str:
        return f"{self.name}.weight"

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ShardDecision:
    """What the declare stage decided for one declared weight, and the one-line reason."""

    layer: int
    name: str
    sharded: bool
    reason: str

    def line(self) -> str:
        return f"layer {self.layer}: {self.name}: {'sharded' if self.sharded else 'left alone'} -- {self.reason}"


def group_words(module: nn.Module) -> str:
    """``"group 'attn_tp', tp size 1"``: the parallel group a package linear was built on, in words."""
    spec = getattr(module, "parallel_group", None)
    name = spec if isinstance(spec, str) else ("tp" if spec is None else type(spec).__name__)
    return f"group {name!r}, tp size {_tp_size(module)}"


def _target_name(layer_id: int, layer: nn.Module, target: str | nn.Module) -> str:
    """A declared target as an attribute path: a module given itself is looked up in ``layer``."""
    if isinstance(target, str):
        return target
    for name, mod in layer.named_modules():
        if mod is target and name:
            return name
    raise ShardingError(f"layer {layer_id}: a declared {type(target).__name__} is not a submodule of the layer: "
                        "pass the layer's own linears (or their attribute paths)")


def _tp_size(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return 1
    return int(getattr(module, "tp_size", 1))


def _row_blocks(module: nn.Module, rows: int) -> list[RowBlock]:
    fn = getattr(module, "row_sub_blocks", None)
    return list(fn()) if fn is not None else [(None, 0, rows, 0)]


def row_window(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a weight that ``rank`` keeps after setup (its 1/N row shard)."""
    per = rows // world
    return rank * per, (rank + 1) * per


class RowShardLoader:
    """Weight loader installed on a sharded parameter: copies only this rank's rows.

    ``loaded_weight`` may be a tensor or a lazy safetensors slice (``get_slice``): only the needed
    row range is read from it. For merged linears the checkpoint holds one tensor per sub-block;
    ``loaded_shard_id`` picks the sub-block, whose rows are intersected with this rank's window.
    """

    def __init__(self, target: ShardTarget, rank: int, world: int) -> None:
        self.target = target
        self.window = row_window(target.rows, rank, world)
        self.loaded_rows = 0

    def __call__(self, param: torch.Tensor, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
        t = self.target
        blocks = [b for b in t.row_blocks if b[0] == loaded_shard_id] if len(t.row_blocks) > 1 else t.row_blocks
        if not blocks:
            ids = [b[0] for b in t.row_blocks]
            raise ShardingError(f"{t.name}: no sub-block with shard id {loaded_shard_id!r} (known: {ids})")
        _, param_off, rows, ckpt_off = blocks[0]
        shape = tuple(loaded_weight.get_shape()) if hasattr(loaded_weight, "get_shape") else tuple(loaded_weight.shape)
        want_cols = t.shape[1:]
        if len(shape) != len(t.shape) or shape[1:] != want_cols or shape[0] < ckpt_off + rows:
            raise ShardingError(
                f"{t.name}.weight (shard {loaded_shard_id!r}): checkpoint tensor has shape {list(shape)}, expected "
                f"at least {ckpt_off + rows} rows of {list(want_cols)}"
            )
        w0, w1 = self.window
        a, b = max(w0, param_off), min(w1, param_off + rows)
        if a >= b:
            return  # none of this sub-block's rows live on this rank
        piece = loaded_weight[ckpt_off + (a - param_off) : ckpt_off + (b - param_off)]
        param.data[a - w0 : b - w0].copy_(piece)
        self.loaded_rows += b - a


class WeightSharding:
    """Weight sharding of one model over a shard group.

    ``layers`` are the model's blocks in execution order (index = layer id); ``targets`` maps a
    layer id to its candidate linears -- attribute paths, or the package's linears themselves -- (when
    None, each layer's own ``weight_shard_targets`` list is used, as the seed's modules declare them);
    :meth:`declare` decides which of them are sharded. ``sharded_layers``
    restricts the range (the seed's default leaves the dense layer 0 out).
    """

    def __init__(
        self,
        comm: Communicator,
        layers: Sequence[nn.Module] | None = None,
        targets: Mapping[int, Sequence[str | nn.Module]] | None = None,
        *,
        sharded_layers: Iterable[int] | None = None,
        lookahead: bool = True,
        trace: bool = False,
    ) -> None:
        self.comm = comm
        self.lookahead = lookahead
        self.trace = trace
        self.sharded_range = None if sharded_layers is None else set(sharded_layers)
        self.stage = "declared"
        self.layers: dict[int, nn.Module] = {}
        self.targets: dict[int, list[ShardTarget]] = {}
        self.layouts: dict[int, FlatLayout] = {}
        self.skipped: list[str] = []
        #: Every declared weight, sharded or left alone, with the reason (:meth:`report`).
        self.decisions: list[ShardDecision] = []
        self.loaders: dict[tuple[int, str], RowShardLoader] = {}
        self.chunks: dict[int, torch.Tensor] = {}
        self._shrunk: set[int] = set()
        self.slots: SlotPool | None = None
        self.planner: WeightShardPlanner | None = None
        if layers is not None:
            layers = list(layers)
            for i in self.sharded_range or range(len(layers)):
                if not 0 <= i < len(layers):
                    raise ShardingError(f"sharded layer {i} is outside the model's {len(layers)} layers")
            for i, layer in enumerate(layers):
                names = targets.get(i, []) if targets is not None else None
                self.declare(i, layer, names)
            if not self.targets:
                raise ShardingError("no layer has a shardable target: nothing to shard")

    def declare(self, layer_id: int, layer: nn.Module,
                names: Sequence[str | nn.Module] | None = None) -> list[ShardTarget]:
        """Decide layer ``layer_id``'s targets (``names`` -- attribute paths, or the package's own linears
        themselves -- or the layer's own ``weight_shard_targets``) and fix its flat layout, while every
        weight still has its full shape. Layers outside the sharded range are left alone.

        A package linear (:class:`~wsharding.linear.LinearBase`) is decided by its group (the Linear
        contract): tp size 1 -> a target; tp size > 1 -> left alone, tensor parallelism already splits
        it. Each decision is kept, with its one-line reason, in :attr:`decisions` (:meth:`report`)."""
        if self.stage != "declared":
            raise ShardingError(f"declare() after {self.stage}: declare every layer before finalize")
        if layer_id in self._shrunk:
            raise ShardingError(f"layer {layer_id}: declare() after setup_layer(): its targets already hold 1/N "
                                "rows, and a layout needs the full shapes. Declare a layer before it shrinks")
        if self.sharded_range is not None and layer_id not in self.sharded_range:
            return []
        names = getattr(layer, "weight_shard_targets", []) if names is None else names
        chosen = []
        for n in names:
            t = self._validate(layer_id, layer, _target_name(layer_id, layer, n))
            if t is not None:
                chosen.append(t)
        if chosen:
            self.layers[layer_id] = layer
            self.targets[layer_id] = chosen
            # Attention and MoE targets of a layer share one layout: one gather per layer.
            self.layouts[layer_id] = FlatLayout([(t.entry, t.shape, t.dtype) for t in chosen], self.comm.world_size)
        return chosen

    def report(self) -> str:
        """One line per declared weight: sharded or left alone, and why."""
        return "\n".join(d.line() for d in self.decisions)

    # ---- 1. declare / validate --------------------------------------------------------------------
    def _decide(self, layer_id: int, name: str, sharded: bool, reason: str) -> None:
        self.decisions.append(ShardDecision(layer_id, name, sharded, reason))

    def _validate(self, layer_id: int, layer: nn.Module, name: str) -> ShardTarget | None:
        try:
            module = layer.get_submodule(name)
        except AttributeError:
            raise ShardingError(f"layer {layer_id}: declared target {name!r} does not exist") from None
        tp = _tp_size(module)
        if isinstance(module, LinearBase):
            group = group_words(module)
            if tp != 1:
                self._decide(layer_id, name, False, f"{group}: tensor parallelism already splits it, "
                                                    "its bytes differ between ranks")
                return None
            why = f"{group}: the same bytes on every rank"
        elif tp != 1:
            raise ShardingError(
                f"layer {layer_id}: target {name!r} has tp_size {tp}; weight sharding only applies to weights "
                "replicated byte for byte on every rank (tp_size 1: ReplicatedLinear, or merged/QKV linears "
                "built with the 'replicated' group). Remove it from the targets or build it with tp 1."
            )
        else:
            why = f"{type(module).__name__} (not split): the same bytes on every rank"
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ShardingError(f"layer {layer_id}: target {name!r} has no 2-D weight to shard")
        rows = weight.shape[0]
        if rows % self.comm.world_size:
            msg = (f"layer {layer_id}: {name}.weight has {rows} rows, not divisible by the group size "
                   f"{self.comm.world_size}: left replicated")
            warnings.warn(msg, ShardingSkipWarning, stacklevel=4)
            self.skipped.append(f"{layer_id}:{name}")
            self._decide(layer_id, name, False, f"{rows} rows, not divisible by the group size {self.comm.world_size}")
            return None
        self._decide(layer_id, name, True, why)
        return ShardTarget(layer_id, name, module, tuple(weight.shape), weight.dtype, _row_blocks(module, rows))

    # ---- 2. setup: keep only this rank's rows -------------------------------------------------------
    def setup_layer(self, layer_id: int) -> None:
        """Shrink layer ``layer_id``'s targets to this rank's 1/N rows and install row-shard loaders.

        A model calls it at the end of each layer's construction, so at most one layer's full
        weights exist at a time. The rows kept are copied from the current weight (a model built
        with real weights is sharded as it is); a checkpoint loaded later goes through the loaders.
        """
        if layer_id in self._shrunk or layer_id not in self.targets:
            return
        rank, world = self.comm.rank, self.comm.world_size
        for t in self.targets[layer_id]:
            w0, w1 = row_window(t.rows, rank, world)
            p = t.module.weight
            if p.is_meta:
                rows = torch.empty((w1 - w0, *t.shape[1:]), dtype=t.dtype, device=self.comm.device)
            else:
                rows = p.data[w0:w1].to(self.comm.device, copy=True)
            p.data = rows  # the full storage is released when nothing else holds it
            loader = RowShardLoader(t, rank, world)
            p.weight_loader = loader
            self.loaders[(layer_id, t.name)] = loader
        self._shrunk.add(layer_id)

    def setup(self) -> WeightSharding:
        """:meth:`setup_layer` for every declared layer."""
        self._expect("declared", "setup")
        for i in sorted(self.targets):
            self.setup_layer(i)
        self.stage = "setup"
        return self

    # ---- 3. finalize: row shards -> flat chunks, slots, views --------------------------------------
    def finalize(self) -> WeightSharding:
        """Redistribute row shards into flat chunks, free them, allocate the slots, bind the views.

        Collective: every rank calls it. Buffers are allocated in layer order on every rank and, with
        a symmetric-memory backend, registered as windows in one collective call sorted by tag.

        The redistribution gathers one weight at a time *through slot B*, in place: this rank's rows
        are copied to their place in the slot, one gather fills the rest, and the rank keeps the
        bytes that fall inside its own chunk window. Slot B is at least as large as any layer, so no
        temporary full weight is allocated, and the gather runs inside a registered window (which a
        copy-engine backend requires). Each layer's row shards are freed as soon as it is done.
        """
        if self.stage == "declared":
            self.setup()
        self._expect("setup", "finalize")
        if not self.targets:
            raise ShardingError("no layer has a shardable target: nothing to shard")
        comm = self.comm
        rank, world = comm.rank, comm.world_size
        # Buffer tags name symmetric windows and must be unique on a communicator that outlives one
        # model: number the shardings made on it (the same count on every rank).
        k = _SHARDINGS_ON.get(comm, 0)
        _SHARDINGS_ON[comm] = k + 1
        for i in sorted(self.targets):
            self.chunks[i] = comm.alloc(self.layouts[i].chunk_bytes, tag=f"ws{k}.layer.{i}.chunk")
        self.slots = SlotPool(comm, self.layouts, tag=f"ws{k}.slot")
        register_all = getattr(comm, "register_all", None)
        if register_all is not None:
            register_all()  # collective, one order on every rank
        staging = self.slots.buffers[1]
        for i in sorted(self.targets):
            layout, chunk = self.layouts[i], self.chunks[i]
            chunk.zero_()
            lo, hi = layout.chunk_range(rank)
            for t in self.targets[i]:
                e = layout.entry(t.entry)
                rows = t.module.weight.data.contiguous().view(-1).view(torch.uint8)
                per_rank = e.nbytes // world
                full = staging.narrow(0, 0, e.nbytes)
                mine = full.narrow(0, rank * per_rank, per_rank)
                mine.copy_(rows)
                comm.all_gather_into(full, mine, what=f"finalize of layer {i} {t.entry}")
                a, b = max(lo, e.offset), min(hi, e.end)
                if a < b:
                    chunk[a - lo : b - lo].copy_(full[a - e.offset : b - e.offset])
            views = self.slots.views(i)
            for t in self.targets[i]:
                rebind_tensor(t.module, "weight", views[t.entry])  # frees this layer's row shards
        self.planner = WeightShardPlanner(
            comm,
            {i: ShardedLayer(i, self.layouts[i], self.chunks[i]) for i in self.targets},
            self.slots,
            lookahead=self.lookahead,
            trace=self.trace,
        )
        for i, layer in self.layers.items():
            layer._weight_shard = (self.planner, i)
        on_close = getattr(comm, "on_close", None)
        if on_close is not None:
            on_close(self.close)  # the communicator closes us before it frees the memory we view
        self.stage = "finalized"
        return self

    # ---- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the sharding, in the order that keeps every step safe: hooks, planner, weights, then
        the slots and chunks (on our NCCL backend: their windows are deregistered -- collective, every
        rank calls it -- and the memory freed). A model used afterwards raises :class:`ShardingError`
        instead of reading freed memory. Idempotent; also what ``with WeightSharding(...)`` does."""
        if self.stage == "closed":
            return
        for h in getattr(self, "hook_handles", []):
            h.remove()
        self.hook_handles = []
        if self.planner is not None:
            self.planner.close()
        why = ("this model's weight sharding was closed (WeightSharding.close(), or its communicator was closed): "
               "its sharded weights are gone. Shard a fresh model to run it again")
        for i, layer in self.layers.items():
            layer._weight_shard = None
            self.hook_handles.append(layer.register_forward_pre_hook(_refuse(why, i)))
            for t in self.targets[i]:
                # The Parameter object stays (with its loader), holding no memory: nothing can read
                # the freed slot through it.
                rebind_tensor(t.module, "weight", torch.empty(0, dtype=t.dtype, device=self.comm.device))
        release = getattr(self.comm, "release", None)
        buffers = list(self.chunks.values()) + (list(self.slots.buffers) if self.slots is not None else [])
        self.chunks.clear()
        self.slots = None
        if release is not None and buffers:
            release(buffers)
        self.stage = "closed"

    def __enter__(self) -> WeightSharding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _expect(self, stage: str, what: str) -> None:
        if self.stage != stage:
            raise ShardingError(f"{what}() needs stage {stage!r}, the sharding is at {self.stage!r}")

    # ---- accounting --------------------------------------------------------------------------------
    @property
    def sharded_layer_ids(self) -> list[int]:
        return sorted(self.targets)

    def replicated_bytes(self) -> int:
        """R: bytes of the target weights that every rank would hold when replicated."""
        return sum(t.nbytes for ts in self.targets.values() for t in ts)

    def formula_bytes(self) -> int:
        """``R/N + padding/N + 2 * max_l |T_l|``: what each rank must hold after finalize.

        A backend that allocates in units (our NCCL binding rounds every window to 4096 B, its
        ``alloc_granularity``) rounds each chunk and slot up to that unit.
        """
        g = getattr(self.comm, "alloc_granularity", 1)
        slot = align_up(max(lay.total_bytes for lay in self.layouts.values()), g)
        return sum(align_up(lay.chunk_bytes, g) for lay in self.layouts.values()) + 2 * slot

    def resident_bytes(self) -> int:
        """Bytes actually allocated for sharded weights on this rank (chunks + two slots), measured
        from the storages, not from the layout."""
        self._expect("finalized", "resident_bytes")
        storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in self.chunks.values()}
        for b in self.slots.buffers:
            storages[id(b.untyped_storage())] = b.untyped_storage().nbytes()
        return sum(storages.values())

    def describe(self) -> list[dict[str, Any]]:
        """Per sharded layer: targets, layout bytes, chunk bytes and slot."""
        return [
            {
                "layer": i,
                "targets": [t.name for t in self.targets[i]],
                "layout_bytes": self.layouts[i].total_bytes,
                "chunk_bytes": self.layouts[i].chunk_bytes,
                "slot": "AB"[self.slots.slot_of(i)] if self.slots else "AB"[k % 2],
            }
            for k, i in enumerate(self.sharded_layer_ids)
        ]


def _refuse(why: str, layer_id: int) -> Callable[..., None]:
    def hook(_mod: nn.Module, _args: Any) -> None:
        raise ShardingError(f"layer {layer_id}: {why}")

    return hook


def prepare_layer_weight_shard_forward(layer: nn.Module) -> None:
    """Called at the start of a sharded layer's forward: wait (once) until its weights are in its
    slot. A layer that is not sharded returns at once."""
    ws = getattr(layer, "_weight_shard", None)
    if ws is not None:
        planner, layer_id = ws
        planner.wait_ready_once(layer_id)


def run_layers(
    layers: Sequence[nn.Module],
    hidden: Any,
    planner: WeightShardPlanner | None,
    start_layer: int = 0,
    end_layer: int | None = None,
    call: Callable[[nn.Module, Any], Any] | None = None,
) -> Any:
    """The seed's layer loop with the planner wired in (``planner=None``: plain replicated loop)."""
    end = len(layers) if end_layer is None else end_layer
    call = call or (lambda layer, h: layer(h))
    if planner is None:
        for i in range(start_layer, end):
            hidden = call(layers[i], hidden)
        return hidden
    planner.reset()
    planner.pre_dispatch(start_layer, end)
    for i in range(start_layer, end):
        planner.maybe_dispatch(i + 1)  # side stream: AG(i+1), gate = done(i-1)
        hidden = call(layers[i], hidden)  # the layer waits for its own gather at its start
        planner.update_done_event(i, layers[i])
    return hidden


# ---- the generic path: any nn.Module whose blocks sit in a ModuleList ------------------------------
def _is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, (nn.Linear, LinearBase))


def find_targets(block: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Names of the linear submodules (``nn.Linear`` or wsharding linears) of ``block`` that match
    any of ``patterns`` (fnmatch)."""
    return [
        name
        for name, mod in block.named_modules()
        if name and _is_linear(mod) and any(fnmatch.fnmatchcase(name, p) for p in patterns)
    ]


def shard_blocks(
    model: nn.Module,
    blocks: str | nn.ModuleList,
    patterns: Sequence[str],
    comm: Communicator,
    *,
    sharded_layers: Iterable[int] | None = None,
    lookahead: bool = True,
    trace: bool = False,
) -> WeightSharding:
    """Shard the ``nn.Linear`` weights matching ``patterns`` in each block of ``model.<blocks>``.

    Matching package linears are decided by their group: those split by tensor parallelism are left
    alone, each with its reason in ``ws.report()``.

    The model's own forward is unchanged: hooks on the model start each step (reset, pre_dispatch)
    and hooks on each block dispatch the next block's gather, wait for the block's own, and record
    its end. Returns the finalized :class:`WeightSharding` (``.planner`` has the counters and trace).
    """
    block_list = model.get_submodule(blocks) if isinstance(blocks, str) else blocks
    if not isinstance(block_list, nn.ModuleList):
        raise ShardingError(f"{blocks!r} is a {type(block_list).__name__}, expected the nn.ModuleList of blocks")
    targets = {i: find_targets(b, patterns) for i, b in enumerate(block_list)}
    ws = WeightSharding(comm, block_list, targets, sharded_layers=sharded_layers, lookahead=lookahead, trace=trace)
    ws.setup().finalize()
    planner = ws.planner
    count = len(block_list)

    def start_step(_mod, _args):
        planner.reset()
        planner.pre_dispatch(0, count)

    def end_step(_mod, _args, _out):
        planner.finish_step()

    def before_block(i):
        def hook(_mod, _args):
            planner.maybe_dispatch(i + 1)
            planner.wait_ready_once(i)

        return hook

    def after_block(i):
        def hook(_mod, _args, _out):
            planner.update_done_event(i, block_list[i])

        return hook

    handles = [model.register_forward_pre_hook(start_step), model.register_forward_hook(end_step)]
    for i, b in enumerate(block_list):
        handles.append(b.register_forward_pre_hook(before_block(i)))
        handles.append(b.register_forward_hook(after_block(i)))
    ws.hook_handles = handles
    return ws


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
