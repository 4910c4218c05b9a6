"""Sharding a model's replicated weights: declare, validate, shrink, load rows, finalize, bind.

A sharded weight goes through four stages (SGLang's weight sharding for Kimi K3, "SGLang 中的实现"):

1. **declare / validate** (:class:`WeightSharding` constructor): each layer names its candidates.
   The package's own linears are decided by their group (the parallel contract of SGLang's Linear
   layers): tp size 1 (byte-identical on every rank) -> a target, tp size > 1 -> left alone, as the
   weight-sharding design shards attention only when attn_tp_size == 1 and MoE peripherals only when
   replicated; every decision and its reason is kept (:meth:`WeightSharding.report`). Any other module
   with ``tp_size`` > 1 is an error naming it; a weight whose rows the group size does not divide is
   skipped with a warning. The layer's targets form one :class:`~wsharding.layout.FlatLayout` -- one
   gather per layer. Every decision that needs the full shape is taken here, before anything shrinks.
2. **setup** (:meth:`WeightSharding.setup`): each target keeps only its own 1/N rows; a row-shard
   loader replaces the parameter's weight loader so that a checkpoint is read row range by row range
   (merged linears: per sub-block, :meth:`row_sub_blocks`).
3. **finalize** (:meth:`WeightSharding.finalize`): the row shards are redistributed into the flat
   chunks -- per weight one plain gather (the design's temporary full weight; here it lands in slot B,
   so nothing extra is allocated), of which each rank keeps the bytes inside its own chunk window;
   the row shards are then freed and every target's weight becomes a zero-copy view of its slot.
4. **forward**: the planner gathers each layer's chunk into its slot just in time (the loop and the
   hooks that drive it are in ``runner.py``).
"""

from __future__ import annotations

import operator
import warnings
import weakref
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from wsharding.bound import guard_bound_weight
from wsharding.comm.base import CommError, Communicator
from wsharding.costmodel.bill import bill_for_layouts
from wsharding.guards import BoundWeightGuards
from wsharding.layout import FlatLayout
from wsharding.linear.base import LinearBase, rebind_tensor
from wsharding.mapped_slots import mapping_page_bytes, mapping_unavailable, slot_pool_for
from wsharding.planner import ShardedLayer, WeightShardPlanner, edited_message
from wsharding.redistribute import agree_or_raise, redistribute_layer, set_weight_data
from wsharding.rowloaders import (
    FullShapeLoader,
    RowBlock,
    RowShardLoader,
    ShardingError,
    ShardTarget,
    format_rows,
    row_window,
)
from wsharding.slots import SlotPool
from wsharding.units import align_up

__all__ = [
    "FullShapeLoader", "RowBlock", "RowShardLoader", "ShardTarget", "ShardingError", "ShardingSkipWarning",
    "WeightSharding", "row_window",
]

#: How many shardings were finalized on each communicator: numbers the window tags of the next one.
_SHARDINGS_ON: weakref.WeakKeyDictionary[Communicator, int] = weakref.WeakKeyDictionary()

SHARD_MODES = ("rows", "requant_then_shard")


class ShardingSkipWarning(UserWarning):
    """A declared target left replicated (its rows are not divisible by the group size)."""


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


#: Where a parameter or buffer is held: ``(path, module, attribute)``.
Place = tuple[str, nn.Module, str]


def _tensor_places(root: nn.Module, skip: Container[int] = ()) -> list[Place]:
    """Every parameter and buffer attribute reachable from ``root``, at every path that reaches it (a
    module registered twice is listed twice), in registration order; modules whose ``id`` is in
    ``skip`` are not entered."""
    out: list[Place] = []
    stack: list[tuple[str, nn.Module, frozenset[int]]] = [("", root, frozenset())]
    while stack:
        path, mod, above = stack.pop()
        if id(mod) in skip or id(mod) in above:
            continue
        out += [(f"{path}.{attr}" if path else attr, mod, attr) for attr in [*mod._parameters, *mod._buffers]]
        inner = above | {id(mod)}
        stack += [(f"{path}.{name}" if path else name, child, inner)
                  for name, child in reversed(mod._modules.items()) if child is not None]
    return out


def _storage_key(t: torch.Tensor | None) -> tuple | None:
    """What two tensors that share memory have in common: their storage (a tied weight, or any view
    of it); a meta tensor has no memory, so only the tensor object itself. None: nothing to share."""
    if t is None:
        return None
    if t.is_meta:
        return ("meta", id(t))
    st = t.untyped_storage()
    return (t.device, st.data_ptr()) if st.nbytes() else None


def _held(place: Place) -> torch.Tensor | None:
    """The tensor a place holds now (setup and finalize give targets new storage)."""
    _, mod, attr = place
    return mod._parameters[attr] if attr in mod._parameters else mod._buffers.get(attr)


def _by_storage(places: Iterable[Place]) -> dict[tuple, list[Place]]:
    """``places`` grouped by the storage they hold now (:func:`_storage_key`)."""
    out: dict[tuple, list[Place]] = {}
    for place in places:
        key = _storage_key(_held(place))
        if key is not None:
            out.setdefault(key, []).append(place)
    return out


def layer_indices(sharded_layers: Iterable[int] | None) -> list[int] | None:
    """``sharded_layers`` as a list of layer indices, or None for every layer. A float, a bool or a
    single int would otherwise be read as no layer at all (a set of floats matches no layer id)."""
    if sharded_layers is None:
        return None
    example = "e.g. [1, 2] or range(1, 8)"
    if isinstance(sharded_layers, (str, bytes)) or not isinstance(sharded_layers, Iterable):
        raise ShardingError(f"sharded_layers: got the {type(sharded_layers).__name__} {sharded_layers!r}; pass the "
                            f"layer indices as a list or range, {example}"
                            + (f" ([{sharded_layers}] for that one layer)" if isinstance(sharded_layers, int) else ""))
    layer_ids = []
    for i in sharded_layers:
        try:
            layer_ids.append(operator.index(i) if not isinstance(i, bool) else None)
        except TypeError:
            layer_ids.append(None)
        if layer_ids[-1] is None:
            raise ShardingError(f"sharded_layers: {i!r} (a {type(i).__name__}) is not a layer index; pass whole "
                                f"numbers, {example}")
    return layer_ids


def _next_sharding_number(comm: Communicator) -> int:
    """The number of this sharding on ``comm`` (the same on every rank: each one finalizes, or
    abandons, every sharding in the same order)."""
    k = _SHARDINGS_ON.get(comm, 0)
    _SHARDINGS_ON[comm] = k + 1
    return k


def abandon_sharding(comm: Communicator, why: str) -> None:
    """This rank cannot reach :meth:`WeightSharding.finalize` of a sharding its peers are building (its
    declare, setup or load raised): take part in finalize's agreement with a problem instead, so that
    every peer raises a :class:`ShardingError` naming this rank rather than waiting in a gather that
    never comes. Returns; the caller raises its own error. A communicator that fails here (its peers
    are gone too) is left to that error."""
    try:
        agree_or_raise(comm, {}, [why], tag=f"ws{_next_sharding_number(comm)}.agree")
    except (ShardingError, CommError):
        pass


class WeightSharding:
    """Weight sharding of one model over a shard group.

    ``layers`` are the model's blocks in execution order (index = layer id); ``targets`` maps a
    layer id to its candidate linears -- attribute paths, or the package's linears themselves -- (when
    None, each layer's own ``weight_shard_targets`` list is used, as the modules of the weight-sharding
    design declare them); :meth:`declare` decides which of them are sharded. ``sharded_layers``
    restricts the range (the design's default leaves the dense layer 0 out).

    ``keep_initial_weights``: a model built with real weights is sharded as it is -- setup copies
    this rank's rows and counts them as loaded. With False, setup allocates zeroed rows and every row
    must then come from a checkpoint (finalize refuses any that did not). A model built on the meta
    device always needs its rows loaded.

    ``prefetch_next_step``: the planner issues each step's first gather during the previous step's
    last layers ([Note: the next step's first gather] in ``wsharding/planner.py``); off by default.

    ``map_own_chunk``: each layer gathers into an address range whose own slice is mapped over its
    resident chunk, so no gather copies the rank's own chunk ([Note: the own chunk mapped, not copied]
    in ``wsharding/mapped_slots.py``); needs our NCCL communicator and NCCL >= 2.30. ``"auto"`` (the
    default): on where it can run and holds no more than plain slots, decided at :meth:`setup`
    ([Note: map_own_chunk="auto"]); ``map_own_chunk_reason`` says which and why. True forces it
    (raises where it cannot run), False keeps plain slots.
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
        keep_initial_weights: bool = True,
        prefetch_next_step: bool = False,
        map_own_chunk: bool | Literal["auto"] = "auto",
    ) -> None:
        self.comm = comm
        if map_own_chunk not in (True, False, "auto"):
            raise ShardingError(f"map_own_chunk must be True, False or 'auto', got {map_own_chunk!r}")
        self._map_auto = map_own_chunk == "auto"
        why_not = mapping_unavailable(comm) if self._map_auto else None
        #: Whether the layers gather into views mapped over their chunks. With "auto" it is the
        #: tentative choice until :meth:`setup` settles it.
        self.map_own_chunk = map_own_chunk is True or (self._map_auto and why_not is None)
        #: One line: mapped or not, and why.
        if self._map_auto:
            self.map_own_chunk_reason = (f"own chunk copied: {why_not}" if why_not is not None
                                         else "own chunk mapped (tentative: setup() compares the page padding)")
        else:
            self.map_own_chunk_reason = (f"own chunk {'mapped' if map_own_chunk else 'copied'}: asked for "
                                         f"(map_own_chunk={map_own_chunk})")
        # Checked before anything is declared: a chunk must be whole pages to be mapped.
        self._chunk_alignment = mapping_page_bytes(comm) if self.map_own_chunk else None
        self.lookahead = lookahead
        self.prefetch_next_step = prefetch_next_step
        self.trace = trace
        self.keep_initial_weights = keep_initial_weights
        indices = layer_indices(sharded_layers)
        self.sharded_range = None if indices is None else set(indices)
        self.stage = "declared"
        self.layers: dict[int, nn.Module] = {}
        self.targets: dict[int, list[ShardTarget]] = {}
        self.layouts: dict[int, FlatLayout] = {}
        self.skipped: list[str] = []
        #: Every declared weight, sharded or left alone, with the reason (:meth:`report`).
        self.decisions: list[ShardDecision] = []
        self.loaders: dict[tuple[int, str], RowShardLoader | FullShapeLoader] = {}
        self.chunks: dict[int, torch.Tensor] = {}
        self._shrunk: set[int] = set()
        #: Every declared block (sharded or not) and its tensors' places by storage: the tie check's index.
        self._declared_blocks: dict[int, tuple[nn.Module, dict[tuple, list[Place]]]] = {}
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
        # Every block is indexed, sharded or not: a target whose storage a block left replicated also
        # holds is as wrong as one tied between sharded blocks (_refuse_ties).
        places = _by_storage(_tensor_places(layer))
        self._declared_blocks[layer_id] = (layer, places)
        earlier = [t for i, ts in self.targets.items() if i != layer_id for t in ts]
        if self.sharded_range is not None and layer_id not in self.sharded_range:
            self._refuse_ties(earlier, places, f"layer {layer_id} ")
            return []
        if getattr(layer, "_weight_shard", None) is not None:
            # Its weights are views of another sharding's slot: sharded again, the two planners would
            # gather into each other's slots and the outputs would be silently wrong.
            raise ShardingError(
                f"layer {layer_id} on rank {self.comm.rank}: this module is already sharded by a WeightSharding that is "
                "still open (its weights are views of that sharding's slots). Use that sharding, or close it "
                "(ws.close()) and shard a freshly built model")
        if getattr(layer, "_weight_shard_closed", False):
            raise ShardingError(
                f"layer {layer_id} on rank {self.comm.rank}: this module's weight sharding was closed and its sharded "
                "weights freed; nothing is left to shard. Shard a freshly built model (or load its checkpoint into one)")
        names = getattr(layer, "weight_shard_targets", []) if names is None else names
        chosen, left = [], []
        for n in names:
            name = _target_name(layer_id, layer, n)
            t = self._validate(layer_id, layer, name)
            if isinstance(t, ShardTarget):
                chosen.append(t)
            elif t is not None:
                left.append(f"{name}.weight ({t} rows)")
        # One warning per layer, on rank 0 only: every rank skips the same weights, and a model of
        # 60 layers x 4 weights x 8 ranks would otherwise print 1920 lines for one decision.
        if left and self.comm.rank == 0:
            warnings.warn(f"layer {layer_id}: {len(left)} weight{'s' * (len(left) > 1)} left replicated, rows not "
                          f"divisible by the group size {self.comm.world_size}: {', '.join(left)}",
                          ShardingSkipWarning, stacklevel=3)
        for t in chosen:
            # A weight tied between two layers (or one block at two places of the list) would be shrunk,
            # bound to a slot and gathered once per place: each sharded layer needs weights of its own.
            for other, ts in [*self.targets.items(), (layer_id, chosen[:chosen.index(t)])]:
                same = next((o for o in ts if o.module.weight is t.module.weight), None)
                if same is not None:
                    raise ShardingError(
                        f"layer {layer_id} {t.name}.weight on rank {self.comm.rank} is the same weight as layer {other} "
                        f"{same.name}.weight (a block or weight shared between layers): each sharded layer needs "
                        "weights of its own. Leave one of the layers out (sharded_layers=...), or untie the weights")
        # Then every other holder of a target's storage: of this layer's targets in this block and in
        # the blocks declared before, of earlier layers' targets in this block.
        self._refuse_ties(chosen, places, f"layer {layer_id} ", own_layer=True)
        for other, (_, elsewhere) in self._declared_blocks.items():
            if other != layer_id:
                self._refuse_ties(chosen, elsewhere, f"layer {other} ", recheck=True)
        self._refuse_ties(earlier, places, f"layer {layer_id} ")
        if chosen:
            self.layers[layer_id] = layer
            self.targets[layer_id] = chosen
            for t in chosen:
                # Loading reads this: the linear's own after-loading step runs at finalize instead.
                t.module.weight_shard_target = t
            # Attention and MoE targets of a layer share one layout: one gather per layer.
            self.layouts[layer_id] = FlatLayout([(t.entry, t.shape, t.dtype) for t in chosen], self.comm.world_size,
                                                chunk_alignment=self._chunk_alignment)
        return chosen

    def _refuse_ties(self, targets: Sequence[ShardTarget], held: Mapping[tuple, list[Place]], where: str, *,
                     own_layer: bool = False, recheck: bool = False, of: str = "") -> None:
        """Raise when a place of ``held`` (places by storage) holds a target's storage. ``own_layer``:
        the places are the targets' own layer, where the target's own attribute (its module's
        ``weight``) is not a tie. ``recheck``: ``held`` was indexed earlier, so a place counts only if
        it still holds that storage (memory freed since may have been reused).

        Why refused, even inside the block: setup gives the target's Parameter this rank's rows and
        finalize a view of a slot that other layers' gathers overwrite. Every other holder would read
        another layer's weights when it runs outside the layer (a head tied to a block's weight), keep
        the full replicated memory and miss what loading writes (a separate tensor over the same
        storage), or be loaded and processed as a replicated weight (a package linear that is not a
        target runs its after-loading step on the row shard)."""
        for t in targets:
            key = _storage_key(t.module.weight)
            for place in held.get(key, ()) if key is not None else ():
                if own_layer and place[1] is t.module and place[2] == "weight":
                    continue
                if recheck and _storage_key(_held(place)) != key:
                    continue
                holder = f"{where}{place[0]}"
                raise ShardingError(
                    f"{t.label} on rank {self.comm.rank} is a sharding target, and its storage is also {holder}{of} "
                    "(a tied weight): sharded, that memory is replaced by this rank's rows and then by a view of a "
                    "slot that other layers' gathers overwrite, so that holder would read stale rows or another "
                    f"layer's weights. Untie them (give {holder} a tensor of its own), or leave {t.name} out of the "
                    "targets")

    def refuse_tied_to(self, model: nn.Module) -> None:
        """Raise :class:`ShardingError` when a target's storage is shared with any parameter or buffer
        of ``model`` outside the declared blocks (a head or an embedding tied to a block's weight).

        :meth:`declare` checks the blocks it is given (each block against itself and the others);
        only the whole model shows the rest. :func:`~wsharding.runner.shard_blocks` (and so
        :func:`~wsharding.checkpoint.load_sharded`) calls this before setup; call it likewise when
        building a WeightSharding from a model's blocks yourself."""
        skip = {id(block) for block, _ in self._declared_blocks.values()}
        self._refuse_ties([t for ts in self.targets.values() for t in ts], _by_storage(_tensor_places(model, skip)), "",
                          of=" of the model")

    def report(self) -> str:
        """One line per declared weight: sharded or left alone, and why."""
        return "\n".join(d.line() for d in self.decisions)

    # ---- 1. declare / validate --------------------------------------------------------------------
    def _decide(self, layer_id: int, name: str, sharded: bool, reason: str) -> None:
        self.decisions.append(ShardDecision(layer_id, name, sharded, reason))

    def _validate(self, layer_id: int, layer: nn.Module, name: str) -> ShardTarget | int | None:
        """The target; or the row count of a weight left replicated because N does not divide its
        rows (declare warns once for the layer); or None for a weight the Linear contract leaves alone."""
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
        method = getattr(module, "quant_method", None)
        mode = getattr(method, "weight_shard_mode", "rows") if method is not None else "rows"
        if mode is None:
            raise ShardingError(
                f"layer {layer_id}: target {name!r} uses {type(method).__name__}, which weight sharding cannot "
                f"shard: {getattr(method, 'weight_shard_refusal', '') or 'it declares no weight_shard_mode'}. "
                "Leave it out of the targets, or quantize it with a method that can be sharded "
                "(unquantized, int8, fp8, fp8_block)."
            )
        if mode not in SHARD_MODES:
            raise ShardingError(f"layer {layer_id}: target {name!r}: {type(method).__name__}.weight_shard_mode is "
                                f"{mode!r}; expected one of {SHARD_MODES}")
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ShardingError(f"layer {layer_id}: target {name!r} has no 2-D weight to shard")
        rows = weight.shape[0]
        if rows % self.comm.world_size:
            self.skipped.append(f"{layer_id}:{name}")
            self._decide(layer_id, name, False, f"{rows} rows, not divisible by the group size {self.comm.world_size}")
            return rows
        self._decide(layer_id, name, True, why)
        return ShardTarget(layer_id, name, module, tuple(weight.shape), weight.dtype, _row_blocks(module, rows), mode)

    # ---- 2. setup: keep only this rank's rows -------------------------------------------------------
    def setup_layer(self, layer_id: int) -> None:
        """Shrink layer ``layer_id``'s targets to this rank's 1/N rows and install row-shard loaders
        (requant-then-shard targets keep their full shape, and a loader that records what arrives).

        A model calls it at the end of each layer's construction, so at most one layer's full
        weights exist at a time. The rows kept are copied from the current weight (a model built
        with real weights is sharded as it is); a checkpoint loaded later goes through the loaders.
        """
        if layer_id in self._shrunk or layer_id not in self.targets:
            return
        rank, world, dev = self.comm.rank, self.comm.world_size, self.comm.device
        for t in self.targets[layer_id]:
            p = t.module.weight
            keep = self.keep_initial_weights and not p.is_meta
            inner = getattr(p, "weight_loader", None)
            if t.mode == "rows":
                w0, w1 = row_window(t.rows, rank, world)
                shape = (w1 - w0, *t.shape[1:])
                data = p.data[w0:w1].to(dev, copy=True) if keep else torch.zeros(shape, dtype=t.dtype, device=dev)
                loader: RowShardLoader | FullShapeLoader = RowShardLoader(t, rank, world)
            else:
                data = p.data.to(dev) if keep else torch.zeros(t.shape, dtype=t.dtype, device=dev)
                loader = FullShapeLoader(t, inner)
            p = set_weight_data(t.module, data)  # the full storage is released when nothing else holds it
            if keep:
                loader.coverage.mark_all()
            p.weight_loader = loader
            self.loaders[(layer_id, t.name)] = loader
        self._shrunk.add(layer_id)

    def setup(self) -> WeightSharding:
        """:meth:`setup_layer` for every declared layer (after settling ``map_own_chunk="auto"``: every
        layer is declared now)."""
        self._expect("declared", "setup")
        self._settle_mapping()
        for i in sorted(self.targets):
            self.setup_layer(i)
        self.stage = "setup"
        return self

    def _settle_mapping(self) -> None:
        """[Note: map_own_chunk="auto"]: keep the page-aligned layouts only if mapping holds no more
        than plain slots would. The layouts are metadata until finalize: nothing was cut by them yet
        (setup keeps rows, and rows do not depend on the chunk size)."""
        if not (self._map_auto and self.map_own_chunk and self.layouts):
            return
        n, g = self.comm.world_size, self.comm.alloc_granularity
        # the same entries at the same offsets: only the chunk's alignment (so the tail padding) differs
        plain = {i: FlatLayout.from_entries(lay.entries, n, alignment=lay.alignment) for i, lay in self.layouts.items()}
        mapped_bytes = resident_formula(self.layouts.values(), n, g, mapped=True)
        plain_bytes = resident_formula(plain.values(), n, g, mapped=False)
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        if mapped_bytes <= plain_bytes:
            self.map_own_chunk_reason = (f"own chunk mapped: {mib(mapped_bytes)} per rank against {mib(plain_bytes)} with "
                                         "plain slots, and no own-chunk copy per gather")
            return
        self.map_own_chunk_reason = (f"own chunk copied: mapped, the {self._chunk_alignment >> 20} MiB page padding of "
                                     f"every chunk would hold {mib(mapped_bytes)} per rank against {mib(plain_bytes)} "
                                     "with plain slots")
        self.map_own_chunk = False
        self._chunk_alignment = None
        self.layouts = plain

    # ---- 3. finalize: row shards -> flat chunks, slots, views --------------------------------------
    def finalize(self, observe: Callable[[str, int | None], None] | None = None) -> WeightSharding:
        """Redistribute row shards into flat chunks, run the after-loading step, bind the views.

        Collective: every rank calls it. First every rank checks its targets (every row loaded, shape
        and dtype as declared) and the ranks agree on the verdict and on every layer's layout, so a bad
        rank -- or ranks that declared different targets -- raise everywhere, naming the cause, instead
        of leaving the others in a gather or pairing different weights. Then the two slots are
        allocated (and registered, with a symmetric-memory backend), and layer by layer:

        1. this layer's row shards are packed into slot A and freed;
        2. its chunk is allocated -- about the bytes just freed, so the peak stays at about
           ``R/N + 2 slots`` plus one transient weight ([Note: finalize peak] in
           :mod:`wsharding.redistribute`);
        3. per weight, the full weight is rebuilt in slot B (one gather, in place: the weight-sharding
           design's temporary full weight costs nothing extra and lies in a registered window), the linear's
           ``process_weights_after_loading`` runs on it (every rank computes the same bytes), and the
           rank keeps the bytes inside its chunk window. A requant-then-shard weight is already full:
           it is processed where it is and cut without a gather;
        4. the weights become zero-copy views of their slot.

        Chunks are registered in one more collective call at the end, in layer order on every rank.
        ``observe(stage, layer)``, when given, is called after each of these steps (figures of the
        redistribution peak: notebook 04 §3).
        """
        def seen(stage: str, layer: int | None = None) -> None:
            if observe is not None:
                observe(stage, layer)

        if self.stage == "declared":
            self.setup()
        self._expect("setup", "finalize")
        if not self.targets:
            raise ShardingError("no layer has a shardable target: nothing to shard")
        comm = self.comm
        problems = self.check_loaded()
        # Buffer tags name symmetric windows and must be unique on a communicator that outlives one
        # model: number the shardings made on it (the same count on every rank).
        k = _next_sharding_number(comm)
        # Before the slots: their size, their registration and every gather below depend on the layouts,
        # so ranks that declared different ones (or a rank that cannot finalize) raise together here.
        agree_or_raise(comm, self.layouts, problems, tag=f"ws{k}.agree")
        self.slots = slot_pool_for(comm, self.layouts, tag=f"ws{k}.slot", map_own_chunk=self.map_own_chunk)
        comm.register_all()  # collective, one order on every rank
        seen("slots")
        for i in sorted(self.targets):
            redistribute_layer(comm, self.layouts[i], self.targets[i], self.slots, self.chunks, i,
                               f"ws{k}.layer.{i}.chunk", seen)
        comm.register_all()  # the chunks: the next gathers read them
        trim = getattr(self.slots, "trim", None)
        if trim is not None:
            trim()  # mapped slots: nothing reads a slot's own page any more ([Note: the own chunk mapped, not copied])
        self.planner = WeightShardPlanner(
            comm,
            {i: ShardedLayer(i, self.layouts[i], self.slots.gather_chunk(i, self.chunks[i]),
                             tuple((t.label, t.module.weight) for t in self.targets[i])) for i in self.targets},
            self.slots,
            lookahead=self.lookahead,
            trace=self.trace,
            prefetch_next_step=self.prefetch_next_step,
        )
        for i, layer in self.layers.items():
            layer._weight_shard = (self.planner, i)
        comm.on_close(self.close)  # the communicator closes us before it frees the memory we view
        for ts in self.targets.values():
            for t in ts:
                guard_bound_weight(t)
        # autograd, state_dict() and save_checkpoint refused on the bound weights (wsharding/guards.py)
        self.guards = BoundWeightGuards(self)
        self.guards.install()
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
        if getattr(self, "guards", None) is not None:
            self.guards.on_close()
        why = ("this model's weight sharding was closed (WeightSharding.close(), or its communicator was closed): "
               "its sharded weights are gone. Shard a fresh model to run it again")
        for i, layer in self.layers.items():
            layer._weight_shard = None
            layer._weight_shard_closed = True
            self.hook_handles.append(layer.register_forward_pre_hook(_refuse(why, i)))
            for t in self.targets[i]:
                # The Parameter object stays (with its loader), holding no memory: nothing can read
                # the freed slot through it.
                rebind_tensor(t.module, "weight", torch.empty(0, dtype=t.dtype, device=self.comm.device))
        buffers = list(self.chunks.values()) + (self.slots.owned_buffers() if self.slots is not None else [])
        self.chunks.clear()
        self.slots = None
        if buffers:
            self.comm.release(buffers)
        self.stage = "closed"

    def __enter__(self) -> WeightSharding:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def check_loaded(self) -> list[str]:
        """What would stop finalize on this rank: rows never loaded, weights changed since declare."""
        problems = []
        for i in sorted(self.targets):
            for t in self.targets[i]:
                w = t.module.weight
                loader = self.loaders[(i, t.name)]
                w0, w1 = loader.window
                want = (w1 - w0, *t.shape[1:])
                if w.dtype != t.dtype or tuple(w.shape) != want:
                    problems.append(f"{t.label} is {w.dtype} {list(w.shape)}, expected {t.dtype} {list(want)}: was "
                                    "the model converted (.to(), .half()) after WeightSharding declared it? Convert "
                                    "dtype and device before sharding")
                    continue
                missing = loader.missing_rows()
                if missing:
                    problems.append(f"{t.label}: rows {format_rows(missing)} (of this rank's rows [{w0}, {w1}) of "
                                    f"{t.rows}) were never loaded")
        return problems

    def full_state_dict(self, model: nn.Module | None = None, *, device: torch.device | str = "cpu"
                        ) -> dict[str, torch.Tensor]:
        """The real full weights, gathered from the chunks, as a state dict (collective).

        After finalize a sharded weight is a view of its slot, so ``model.state_dict()`` returns
        whatever layer last used that slot; this gathers each layer into its own slot (the same
        bytes the planner gathers) and copies its weights out to ``device``. With ``model``: the
        model's whole ``state_dict()`` (every tensor copied to ``device``) with the sharded weights
        replaced; without: only the sharded weights, keyed ``"<layer id>.<target>.weight"``.
        Saving the result (:func:`wsharding.checkpoint.save_checkpoint`) loses nothing.

        A weight edited in place since finalize is refused (its edit is not in the chunks, [Note:
        in-place edits of bound weights] in ``wsharding/planner.py``) -- after the gathers, so that a
        rank that refuses leaves no peer waiting in one.
        """
        self._expect("finalized", "full_state_dict")
        full: dict[int, torch.Tensor] = {}
        for i in sorted(self.targets):
            buf = self.slots.full_buffer(i)
            self.comm.all_gather_into(buf, self.slots.gather_chunk(i, self.chunks[i]), what=f"full_state_dict: layer {i}")
            self.slots.occupy(i)
            views = self.layouts[i].views(buf)
            for t in self.targets[i]:
                full[id(t.module.weight)] = views[t.entry].to(device, copy=True)
        edited = self.planner.edited_weights()
        if edited:
            raise ShardingError(f"full_state_dict: {edited_message(edited)}")
        if model is None:
            return {f"{t.layer}.{t.entry}": full[id(t.module.weight)] for ts in self.targets.values() for t in ts}
        with self.guards.reading_state_dict():  # its sharded weights are replaced below
            state = model.state_dict(keep_vars=True)
        return {k: full[id(v)] if id(v) in full else v.detach().to(device, copy=True) for k, v in state.items()}

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
        ``alloc_granularity``) rounds each chunk and slot up to that unit. With ``map_own_chunk`` a
        slot keeps only the peers' pages after finalize: ``2 * (N-1)/N * max_l |T_l|``.
        """
        return resident_formula(self.layouts.values(), self.comm.world_size, self.comm.alloc_granularity,
                                mapped=self.map_own_chunk)

    def _slot_page_bytes(self) -> int:
        """With ``map_own_chunk``: one rank's page of a slot, the largest chunk in allocation units."""
        return align_up(max(lay.chunk_bytes for lay in self.layouts.values()), self.comm.alloc_granularity)

    def finalize_bound_bytes(self) -> int:
        """The most this rank should hold while :meth:`finalize` runs: :meth:`formula_bytes` plus the
        largest weight (one layer's row shards on their way into its chunk). With ``map_own_chunk``
        also this rank's own page of each slot: finalize gathers through whole slots, and only the
        trim at its end gives those pages back."""
        own_pages = 2 * self._slot_page_bytes() if self.map_own_chunk else 0
        return self.formula_bytes() + self.largest_weight_bytes() + own_pages

    def held_bytes(self) -> dict[str, int]:
        """Bytes of sharded weights this rank holds now, from the storages: ``"weights"`` (row shards,
        or full weights of requant-then-shard targets, still outside the slots), ``"chunks"``,
        ``"slots"``."""
        slot_ptrs = self.slots.bound_storage_ptrs() if self.slots else set()
        weights: dict[int, int] = {}
        for ts in self.targets.values():
            for t in ts:
                st = t.module.weight.untyped_storage()
                if st.data_ptr() not in slot_ptrs and not t.module.weight.is_meta:
                    weights[st.data_ptr()] = st.nbytes()
        return {
            "weights": sum(weights.values()),
            "chunks": sum(c.untyped_storage().nbytes() for c in self.chunks.values()),
            "slots": sum(b.untyped_storage().nbytes() for b in self.slots.resident_buffers()) if self.slots else 0,
        }

    def largest_weight_bytes(self) -> int:
        """The largest single target weight: the transient of a load or of one finalize gather."""
        return max(t.nbytes for ts in self.targets.values() for t in ts)

    def resident_bytes(self) -> int:
        """Bytes actually allocated for sharded weights on this rank (chunks + two slots), measured
        from the storages, not from the layout."""
        self._expect("finalized", "resident_bytes")
        # keyed by address: a storage's Python object is made anew per call, so its id() can repeat
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*self.chunks.values(), *self.slots.resident_buffers()]}
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


def resident_formula(layouts: Iterable[FlatLayout], world_size: int, granularity: int = 1, *, mapped: bool) -> int:
    """What a rank holds after finalize for these layer layouts: the chunks, plus two slots of
    ``max |T|`` -- or, ``mapped``, the peers' ``N-1`` pages of the largest chunk per slot. Each
    allocation is rounded up to ``granularity`` (a backend's allocation unit).

    The arithmetic is the cost model's (:func:`~wsharding.costmodel.bill.bill_for_layouts`), so the
    bytes the sharding checks itself against and the bytes ``wsharding plan`` promises are one formula."""
    bill = bill_for_layouts(list(layouts), ranks=world_size, map_own_chunk=mapped, granularity=granularity)
    return bill.sharded_resident_bytes


def _refuse(why: str, layer_id: int) -> Callable[..., None]:
    def hook(_mod: nn.Module, _args: Any) -> None:
        raise ShardingError(f"layer {layer_id}: {why}")

    return hook
