"""Sharding a model's replicated weights: declare, validate, shrink, load rows, finalize, bind.

A sharded weight goes through four stages (SGLang's weight sharding for Kimi K3, "SGLang 中的实现"):

1. **declare / validate** (:class:`WeightSharding` constructor, :mod:`wsharding.core.declare`): each
   layer names its candidates; every decision and its reason is kept (:meth:`WeightSharding.report`);
   the layer's targets form one :class:`~wsharding.core.layout.FlatLayout` -- one gather per layer.
2. **setup** (:meth:`WeightSharding.setup`): each target keeps only its own 1/N rows; a row-shard
   loader replaces the parameter's weight loader so that a checkpoint is read row range by row range
   (merged linears: per sub-block, :meth:`row_sub_blocks`).
3. **finalize** (:meth:`WeightSharding.finalize`): the row shards are redistributed into the flat
   chunks -- per weight one plain gather (the design's temporary full weight; here it lands in slot B,
   so nothing extra is allocated), of which each rank keeps the bytes inside its own chunk window;
   the row shards are then freed and every target's weight becomes a zero-copy view of its slot.
4. **forward**: the planner gathers each layer's chunk into its slot just in time (the loop and the
   hooks that drive it are in :mod:`wsharding.core.runner`).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from wsharding.core.bound import bound_parameter, guard_bound_weight
from wsharding.core.comm import CommError, Communicator
from wsharding.core.contract import rebind_tensor
from wsharding.core.declare import ShardDecision, ShardingSkipWarning, target_name, validate_target
from wsharding.core.edits import refuse_edits
from wsharding.core.guards import BoundWeightGuards
from wsharding.core.layout import FlatLayout
from wsharding.core.observe import StepObserver
from wsharding.core.options import ShardingOptions
from wsharding.core.planner import NOT_COPIED, ShardedLayer, WeightShardPlanner
from wsharding.core.plugins import PlannerPlugin
from wsharding.core.redistribute import agree_or_raise, redistribute_layer, set_weight_data
from wsharding.core.replicas import weight_digest
from wsharding.core.resident import resident_formula
from wsharding.core.rowloaders import (
    FullShapeLoader,
    RowShardLoader,
    ShardingError,
    ShardTarget,
    format_rows,
    row_window,
)
from wsharding.core.schedule import check_depth, slot_name
from wsharding.core.slots import SlotPolicy, SlotPool, plain_slot_policy
from wsharding.core.ties import Place, by_storage, refuse_ties, tensor_places
from wsharding.core.units import align_up

#: How many shardings were finalized on each communicator: numbers the window tags of the next one.
_SHARDINGS_ON: weakref.WeakKeyDictionary[Communicator, int] = weakref.WeakKeyDictionary()


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
    tag = f"ws{_next_sharding_number(comm)}.agree"
    if comm.world_size == 1:
        return  # no peer waits in finalize
    try:
        agree_or_raise(comm, {}, [why], tag=tag)
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

    ``verify_replicas``: with weights kept as built, finalize refuses ranks whose targets hold
    different bytes -- built without one seed, their rows would mix different models, silently --
    naming the first such weight on every rank ([Note: digest before the shrink] in
    :mod:`wsharding.core.replicas`: each target is digested at setup, before it shrinks). False
    skips the digests; rows loaded from a checkpoint are not compared.

    ``plugins``: schedule policies (the next step's first gather:
    :class:`wsharding.core.next_step.NextStepPrefetch`), attached at finalize.

    ``prefetch_depth``: gathers issued ahead of the computing layer (``k``, default 1): ``k + 1``
    slots, ``R/N + (k+1) max|T_l|`` resident. ``on_miss``: a layer about to compute whose slot does
    not hold its weights is gathered now (``"gather"``, warned once) or refused (``"raise"``) --
    [Note: checked at use] in ``wsharding/core/step_owner.py``.

    ``map_own_chunk``: passed to ``comm.slot_policy``. Our NCCL communicator maps each layer's own
    slice over its resident chunk, so no gather copies it ([Note: the own chunk mapped, not copied]
    in ``wsharding/accel/mapped_slots.py``; NCCL >= 2.30): ``"auto"`` (the default) where it runs and
    holds no more than plain slots, True forces it, False keeps plain slots; other communicators
    have plain slots only. ``map_own_chunk_reason`` says which and why.

    ``options``: all of the above as one :class:`~wsharding.core.options.ShardingOptions` (what
    :func:`~wsharding.core.runner.shard_blocks` passes), instead of the keyword arguments.

    ``observers`` (an attribute, a list): who watches finalize and every step ([Note: observers] in
    :mod:`wsharding.core.observe`); ``trace=True`` attaches a tracer.
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
        plugins: Sequence[PlannerPlugin] = (),
        map_own_chunk: bool | Literal["auto"] = "auto",
        prefetch_depth: int = 1,
        on_miss: Literal["gather", "raise"] = "gather",
        verify_replicas: bool = True,
        options: ShardingOptions | None = None,
    ) -> None:
        self.comm = comm
        if options is None:
            options = ShardingOptions(sharded_layers, lookahead, trace, keep_initial_weights, plugins, map_own_chunk,
                                      prefetch_depth, on_miss, verify_replicas)
        elif not isinstance(options, ShardingOptions):
            raise ShardingError(f"options: got a {type(options).__name__}; pass a ShardingOptions (or the keyword "
                                "arguments alone)")
        elif (sharded_layers, lookahead, trace, keep_initial_weights, plugins, map_own_chunk, prefetch_depth, on_miss,
              verify_replicas) != (None, True, False, True, (), "auto", 1, "gather", True):
            raise ShardingError("options: given with other keyword arguments of WeightSharding; pass the options "
                                "either as one ShardingOptions or as keyword arguments, not both")
        #: Every option, checked once ([Note: observers] aside: who watches is not an option).
        self.options = options
        #: Who watches finalize and every step ([Note: observers] in wsharding/core/observe.py); the
        #: planner shares this list.
        self.observers: list[StepObserver] = []
        #: Gathers in flight ahead of the computing layer: ``prefetch_depth + 1`` slots.
        self.prefetch_depth = options.prefetch_depth
        #: How the slots are laid out: the communicator's choice for ``map_own_chunk`` (its NCCL
        #: binding's mapped layer views), else plain slots. Asked before anything is declared: a
        #: mapped chunk must be whole pages.
        self.slot_policy: SlotPolicy = (comm.slot_policy(options.map_own_chunk)
                                        or plain_slot_policy(comm, options.map_own_chunk))
        indices = options.sharded_layers
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
        self.shrunk: set[int] = set()
        #: Bytes of the targets that setup found whole (not on meta): the peak a model built with its weights had.
        self.built_whole_bytes = 0
        #: The model, where the sharding built it (:func:`~wsharding.checkpoint.load_sharded` from a function).
        self.model: nn.Module | None = None
        #: Every declared block (sharded or not) and its tensors' places by storage: the tie check's index.
        self.declared_blocks: dict[int, tuple[nn.Module, dict[tuple, list[Place]]]] = {}
        self.slots: SlotPool | None = None
        self.planner: WeightShardPlanner | None = None
        #: Called in finalize each time a layer's row shards are freed (before its chunk is allocated):
        #: on CPU ranks :func:`~wsharding.checkpoint.load_sharded` gives the freed memory back to the
        #: system there, so that the next chunk does not add to the resident set.
        self.after_rows_freed: Callable[[], object] | None = None
        if layers is not None:
            layers = list(layers)
            for i in self.sharded_range or range(len(layers)):
                if not 0 <= i < len(layers):
                    raise ShardingError(f"sharded layer {i} is outside the model's {len(layers)} layers")
            beyond = sorted(k for k in targets or {} if not (isinstance(k, int) and 0 <= k < len(layers)))
            if beyond:  # their targets would be declared nowhere: nothing of them sharded, without a word
                raise ShardingError(
                    f"targets name layers {beyond}, outside the {len(layers)} layers given (0 to {len(layers) - 1}): "
                    "key the targets by the index of each layer in the list of layers")
            for i, layer in enumerate(layers):
                names = targets.get(i, []) if targets is not None else None
                self.declare(i, layer, names)
            if not self.targets:
                raise ShardingError("no layer has a shardable target: nothing to shard")

    def declare(self, layer_id: int, layer: nn.Module,
                names: Sequence[str | nn.Module] | None = None) -> list[ShardTarget]:
        """Decide layer ``layer_id``'s targets (``names`` -- attribute paths, or the package's own
        linears themselves -- or the layer's own ``weight_shard_targets``) and fix its flat layout,
        while every weight still has its full shape. Layers outside the sharded range are left alone.

        A package linear (:class:`~wsharding.core.contract.ParallelLinear`) is decided by its group
        (the Linear contract): tp size 1 -> a target; tp size > 1 -> left alone, tensor parallelism
        already splits it. Each decision is kept, with its one-line reason, in :attr:`decisions`
        (:meth:`report`); the rules of one weight are in :mod:`wsharding.core.declare`."""
        if self.stage != "declared":
            raise ShardingError(f"declare() after {self.stage}: declare every layer before finalize")
        if layer_id in self.shrunk:
            raise ShardingError(f"layer {layer_id}: declare() after setup_layer(): its targets already hold 1/N "
                                "rows, and a layout needs the full shapes. Declare a layer before it shrinks")
        # Every block is indexed, sharded or not: a target whose storage a block left replicated also
        # holds is as wrong as one tied between sharded blocks (refuse_ties).
        places = by_storage(tensor_places(layer))
        self.declared_blocks[layer_id] = (layer, places)
        earlier = [t for i, ts in self.targets.items() if i != layer_id for t in ts]
        if self.sharded_range is not None and layer_id not in self.sharded_range:
            refuse_ties(earlier, places, f"layer {layer_id} ", self.comm.rank)
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
            name = target_name(layer_id, layer, n)
            t = validate_target(layer_id, layer, name, self.comm.world_size, self.decisions)
            if isinstance(t, ShardTarget):
                chosen.append(t)
            elif t is not None:
                self.skipped.append(f"{layer_id}:{name}")
                left.append(f"{name}.weight ({t} rows)")
        # One warning per layer, on rank 0 only: every rank skips the same weights, and a model of
        # 60 layers x 4 weights x 8 ranks would otherwise print 1920 lines for one decision.
        if left and self.comm.rank == 0:
            warnings.warn(f"layer {layer_id}: {len(left)} weight{'s' * (len(left) > 1)} left replicated, rows not "
                          f"divisible by the group size {self.comm.world_size}: {', '.join(left)}",
                          ShardingSkipWarning, stacklevel=3)
        for t in chosen:
            if t.module.weight.is_inference():
                # Finalize tracks in-place edits of every bound weight by its version counter, which an
                # inference tensor does not keep: refused here, before anything of the layer changes.
                raise ShardingError(
                    f"layer {layer_id} {t.name}.weight on rank {self.comm.rank} is an inference tensor (the model was "
                    "built under torch.inference_mode()), and a sharded weight needs the version counter that "
                    "inference tensors do not keep. Build the model outside torch.inference_mode() (torch.no_grad() "
                    "is enough); running the sharded model under inference_mode is fine")
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
        refuse_ties(chosen, places, f"layer {layer_id} ", self.comm.rank, own_layer=True)
        for other, (_, elsewhere) in self.declared_blocks.items():
            if other != layer_id:
                refuse_ties(chosen, elsewhere, f"layer {other} ", self.comm.rank, recheck=True)
        refuse_ties(earlier, places, f"layer {layer_id} ", self.comm.rank)
        if chosen:
            self.layers[layer_id] = layer
            self.targets[layer_id] = chosen
            for t in chosen:
                # Loading reads this: the linear's own after-loading step runs at finalize instead.
                t.module.weight_shard_target = t
            # Attention and MoE targets of a layer share one layout: one gather per layer.
            self.layouts[layer_id] = FlatLayout([(t.entry, t.shape, t.dtype) for t in chosen], self.comm.world_size,
                                                chunk_alignment=self.slot_policy.chunk_alignment)
        return chosen

    def refuse_tied_to(self, model: nn.Module) -> None:
        """Raise :class:`ShardingError` when a target's storage is shared with any parameter or buffer
        of ``model`` outside the declared blocks (a head or an embedding tied to a block's weight).

        :meth:`declare` checks the blocks it is given (each block against itself and the others);
        only the whole model shows the rest. :func:`~wsharding.core.runner.shard_blocks` (and so
        :func:`~wsharding.checkpoint.load_sharded`) calls this before setup; call it likewise when
        building a WeightSharding from a model's blocks yourself."""
        skip = {id(block) for block, _ in self.declared_blocks.values()}
        refuse_ties([t for ts in self.targets.values() for t in ts], by_storage(tensor_places(model, skip)), "",
                    self.comm.rank, of=" of the model")

    def report(self) -> str:
        """One line per declared weight: sharded or left alone, and why."""
        return "\n".join(d.line() for d in self.decisions)

    # ---- 2. setup: keep only this rank's rows -------------------------------------------------------
    def setup_layer(self, layer_id: int) -> None:
        """Shrink layer ``layer_id``'s targets to this rank's 1/N rows and install row-shard loaders
        (requant-then-shard targets keep their full shape, and a loader that records what arrives).

        A model calls it at the end of each layer's construction, so at most one layer's full
        weights exist at a time. The rows kept are copied from the current weight (a model built
        with real weights is sharded as it is); a checkpoint loaded later goes through the loaders.
        """
        if layer_id in self.shrunk or layer_id not in self.targets:
            return
        rank, world, dev = self.comm.rank, self.comm.world_size, self.comm.device
        for t in self.targets[layer_id]:
            p = t.module.weight
            keep = self.options.keep_initial_weights and not p.is_meta
            self.built_whole_bytes += 0 if p.is_meta else t.nbytes
            inner = getattr(p, "weight_loader", None)
            if t.mode == "rows":
                w0, w1 = row_window(t.rows, rank, world)
                shape = (w1 - w0, *t.shape[1:])
                data = p.data[w0:w1].to(dev, copy=True) if keep else torch.zeros(shape, dtype=t.dtype, device=dev)
                loader: RowShardLoader | FullShapeLoader = RowShardLoader(t, rank, world)
            else:
                data = p.data.to(dev) if keep else torch.zeros(t.shape, dtype=t.dtype, device=dev)
                loader = FullShapeLoader(t, inner)
            if keep and self.options.verify_replicas:  # the full weight, before the shrink: [Note: digest before the shrink]
                loader.digest = weight_digest(p.data)
            p = set_weight_data(t.module, data)  # the full storage is released when nothing else holds it
            if keep:
                loader.coverage.mark_all()
            p.weight_loader = loader
            self.loaders[(layer_id, t.name)] = loader
        self.shrunk.add(layer_id)

    def setup(self) -> WeightSharding:
        """:meth:`setup_layer` for every declared layer (after settling ``map_own_chunk="auto"``: every
        layer is declared now)."""
        self._expect("declared", "setup")
        if self.targets:  # every layer is declared: the depth's bound is known ([Note: whole numbers only])
            check_depth(self.prefetch_depth, len(self.targets))
        # every layer is declared now: a policy may go back to plain slots ([Note: map_own_chunk="auto"])
        self.layouts = self.slot_policy.settle(self.layouts, self.comm.world_size, self.comm.alloc_granularity,
                                               slots=self.slot_count)
        for i in sorted(self.targets):
            self.setup_layer(i)
        self.stage = "setup"
        return self

    # ---- 3. finalize: row shards -> flat chunks, slots, views --------------------------------------
    def finalize(self) -> WeightSharding:
        """Redistribute row shards into flat chunks, run the after-loading step, bind the views.

        Collective: every rank calls it. First every rank checks its targets (every row loaded, shape
        and dtype as declared) and the ranks agree on the verdict, on every layer's layout and on the
        bytes of the weights kept as built, so a bad rank -- or ranks that declared different targets,
        or built different weights -- raise everywhere, naming the cause, instead of leaving the
        others in a gather or pairing different weights. Then the two slots are
        allocated (and registered, with a symmetric-memory backend), and layer by layer:

        1. this layer's row shards are packed into slot A and freed;
        2. its chunk is allocated -- about the bytes just freed, so the peak stays at about
           ``R/N + 2 slots`` plus one transient weight ([Note: finalize peak] in
           :mod:`wsharding.core.redistribute`);
        3. per weight, the full weight is rebuilt in slot B (one gather, in place: the weight-sharding
           design's temporary full weight costs nothing extra and lies in a registered window), the linear's
           ``process_weights_after_loading`` runs on it (every rank computes the same bytes), and the
           rank keeps the bytes inside its chunk window. A requant-then-shard weight is already full:
           it is processed where it is and cut without a gather;
        4. the weights become zero-copy views of their slot.

        Chunks are registered in one more collective call at the end, in layer order on every rank.
        The observers (:attr:`observers`) see each of these steps (``finalize_stage``).
        """
        def seen(stage: str, layer: int | None = None) -> None:
            if stage == "rows packed" and self.after_rows_freed is not None:
                self.after_rows_freed()
            for o in self.observers:
                o.finalize_stage(stage, layer)

        if self.stage == "declared":
            self.setup()
        self._expect("setup", "finalize")
        if not self.targets:
            raise ShardingError("no layer has a shardable target: nothing to shard")
        check_depth(self.prefetch_depth, len(self.targets))  # before the depth + 1 slots are allocated
        comm = self.comm
        problems = self.check_loaded()
        # Buffer tags name symmetric windows and must be unique on a communicator that outlives one
        # model: number the shardings made on it (the same count on every rank).
        k = _next_sharding_number(comm)
        # Before the slots: their size, their registration and every gather below depend on the layouts,
        # so ranks that declared different ones (or a rank that cannot finalize) raise together here.
        digests = {t.label: self.loaders[(i, t.name)].digest for i, ts in self.targets.items() for t in ts}
        agree_or_raise(comm, self.layouts, problems, tag=f"ws{k}.agree",
                       digests={label: d for label, d in digests.items() if d is not None})
        self.slots = self.slot_policy.make_pool(comm, self.layouts, tag=f"ws{k}.slot", count=self.slot_count)
        comm.prepare_outside_steps()  # collective: the channel of gathers outside the schedule
        comm.register_all()  # collective, one order on every rank
        seen("slots")
        for i in sorted(self.targets):
            redistribute_layer(comm, self.layouts[i], self.targets[i], self.slots, self.chunks, i,
                               f"ws{k}.layer.{i}.chunk", seen)
        comm.register_all()  # the chunks: the next gathers read them
        self.slots.trim()  # mapped slots: nothing reads a slot's own page any more
        self.planner = WeightShardPlanner(
            comm,
            {i: ShardedLayer(i, self.layouts[i], self.slots.gather_chunk(i, self.chunks[i]),
                             tuple((t.label, t.module.weight) for t in self.targets[i])) for i in self.targets},
            self.slots,
            self.options,
            self.observers,
        )
        for i, layer in self.layers.items():
            layer._weight_shard = (self.planner, i)
        comm.on_close(self.close)  # the communicator closes us before it frees the memory we view
        for ts in self.targets.values():
            for t in ts:
                guard_bound_weight(t, comm.rank, functools.partial(self.planner.reads_own_layer, t.layer))
        # autograd, state_dict() and save_checkpoint refused on the bound weights (wsharding/core/guards.py)
        self.guards = BoundWeightGuards(self)
        self.guards.install()
        self.stage = "finalized"
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused, like the planner's: a sharded model is not copied or saved whole."""
        raise ShardingError(NOT_COPIED)

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
        in-place edits of bound weights] in ``wsharding/core/edits.py``), and so is a weight no longer
        the module's (replaced behind the guard of [Note: bound weights]) -- after the gathers, so that a
        rank that refuses leaves no peer waiting in one.
        """
        self._expect("finalized", "full_state_dict")
        full: dict[int, torch.Tensor] = {}
        self.planner.lend_slots()  # nothing lands in a slot while these gathers fill them
        bound = {(t.layer, t.entry): bound_parameter(t.module) for ts in self.targets.values() for t in ts}
        for i in sorted(self.targets):
            buf = self.slots.full_buffer(i)
            self.comm.all_gather_into(buf, self.slots.gather_chunk(i, self.chunks[i]), what=f"full_state_dict: layer {i}")
            self.planner.filled(i)
            views = self.layouts[i].views(buf)
            for t in self.targets[i]:
                full[id(bound[(t.layer, t.entry)])] = views[t.entry].to(device, copy=True)
        refuse_edits(self.planner.versions.edited(), "full_state_dict: ")
        # A weight replaced behind the registration hook ([Note: bound weights]): the chunks hold the old one.
        replaced = [t.label for ts in self.targets.values() for t in ts
                    if t.module._parameters.get("weight") is not bound[(t.layer, t.entry)]]
        if replaced:
            raise ShardingError(
                f"full_state_dict on rank {self.comm.rank}: {', '.join(replaced)} is no longer the Parameter that "
                "finalize bound to its slot (the module's weight was replaced or deleted), and the resident chunks "
                "hold the old weight. Change weights before finalize, or in a freshly built model that you shard again")
        if model is None:
            return {f"{t.layer}.{t.entry}": full[id(bound[(t.layer, t.entry)])]
                    for ts in self.targets.values() for t in ts}
        with self.guards.reading_state_dict():  # its sharded weights are replaced below
            state = model.state_dict(keep_vars=True)
        return {k: full[id(v)] if id(v) in full else v.detach().to(device, copy=True) for k, v in state.items()}

    # ---- bytes: every number is arithmetic on the layouts (the formula, the cost model's own:
    # resident_formula) or read from the storages themselves, so that the two can be checked against
    # each other ----------------------------------------------------------------------------------------
    def _expect(self, stage: str, what: str) -> None:
        if self.stage != stage:
            raise ShardingError(f"{what}() needs stage {stage!r}, the sharding is at {self.stage!r}")

    @property
    def map_own_chunk(self) -> bool:
        """Whether the layers gather into views mapped over their chunks (tentative until setup)."""
        return self.slot_policy.mapped

    @property
    def sharded_layer_ids(self) -> list[int]:
        return sorted(self.targets)

    def replicated_bytes(self) -> int:
        """R: bytes of the target weights that every rank would hold when replicated."""
        return sum(t.nbytes for ts in self.targets.values() for t in ts)

    @property
    def slot_count(self) -> int:
        """Slots the sharding gathers into: ``prefetch_depth + 1``."""
        return self.prefetch_depth + 1

    def formula_bytes(self) -> int:
        """``R/N + padding/N + (k+1) * max_l |T_l|`` for lookahead depth ``k`` (two slots at the default
        depth 1): what each rank must hold after finalize.

        A backend that allocates in units (our NCCL binding rounds every window to 4096 B, its
        ``alloc_granularity``) rounds each chunk and slot up to that unit. With ``map_own_chunk`` a
        slot keeps only the peers' pages after finalize: ``(k+1) * (N-1)/N * max_l |T_l|``.
        """
        return resident_formula(self.layouts.values(), self.comm.world_size, self.comm.alloc_granularity,
                                mapped=self.map_own_chunk, slots=self.slot_count)

    def _slot_page_bytes(self) -> int:
        """With ``map_own_chunk``: one rank's page of a slot, the largest chunk in allocation units."""
        return align_up(max(lay.chunk_bytes for lay in self.layouts.values()), self.comm.alloc_granularity)

    def finalize_bound_bytes(self) -> int:
        """The most this rank should hold while :meth:`finalize` runs: :meth:`formula_bytes` plus the
        largest weight (one layer's row shards on their way into its chunk). With ``map_own_chunk``
        also this rank's own page of each slot: finalize gathers through whole slots, and only the
        trim at its end gives those pages back."""
        own_pages = self.slot_count * self._slot_page_bytes() if self.map_own_chunk else 0
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
        """Bytes actually allocated for sharded weights on this rank (chunks + slots), measured
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
                "slot": slot_name(self.slots.slot_of(i) if self.slots else k % self.slot_count),
            }
            for k, i in enumerate(self.sharded_layer_ids)
        ]

    @property
    def map_own_chunk_reason(self) -> str:
        """One line: mapped or not, and why."""
        return self.slot_policy.reason


def _refuse(why: str, layer_id: int) -> Callable[..., None]:
    def hook(_mod: nn.Module, _args: Any) -> None:
        raise ShardingError(f"layer {layer_id}: {why}")

    return hook
