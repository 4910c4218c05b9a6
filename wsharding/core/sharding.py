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

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from wsharding.core.accounting import ShardingBytes
from wsharding.core.bound import guard_bound_weight
from wsharding.core.comm import CommError, Communicator
from wsharding.core.contract import rebind_tensor
from wsharding.core.declare import ShardDecision, declare_layer, layer_indices
from wsharding.core.edits import refuse_edits
from wsharding.core.guards import BoundWeightGuards
from wsharding.core.layout import FlatLayout
from wsharding.core.planner import ShardedLayer, WeightShardPlanner
from wsharding.core.plugins import PlannerPlugin
from wsharding.core.redistribute import agree_or_raise, redistribute_layer, set_weight_data
from wsharding.core.replicas import weight_digest
from wsharding.core.rowloaders import (
    FullShapeLoader,
    RowShardLoader,
    ShardingError,
    ShardTarget,
    format_rows,
    row_window,
)
from wsharding.core.schedule import check_depth
from wsharding.core.slots import SlotPolicy, SlotPool, plain_slot_policy
from wsharding.core.ties import Place, by_storage, refuse_ties, tensor_places

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
    try:
        agree_or_raise(comm, {}, [why], tag=f"ws{_next_sharding_number(comm)}.agree")
    except (ShardingError, CommError):
        pass


class WeightSharding(ShardingBytes):
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
    :class:`wsharding.accel.next_step.NextStepPrefetch`), attached at finalize.

    ``prefetch_depth``: gathers issued ahead of the computing layer (``k``, default 1): ``k + 1``
    slots, ``R/N + (k+1) max|T_l|`` resident. ``on_miss``: a layer about to compute whose slot does
    not hold its weights is gathered now (``"gather"``, warned once) or refused (``"raise"``) --
    [Note: checked at use] in ``wsharding/core/planner.py``.

    ``map_own_chunk``: passed to ``comm.slot_policy``. Our NCCL communicator maps each layer's own
    slice over its resident chunk, so no gather copies it ([Note: the own chunk mapped, not copied]
    in ``wsharding/accel/mapped_slots.py``; NCCL >= 2.30): ``"auto"`` (the default) where it runs and
    holds no more than plain slots, True forces it, False keeps plain slots; other communicators
    have plain slots only. ``map_own_chunk_reason`` says which and why.
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
    ) -> None:
        self.comm = comm
        #: Gathers in flight ahead of the computing layer: ``prefetch_depth + 1`` slots.
        self.prefetch_depth = check_depth(prefetch_depth)
        if on_miss not in ("gather", "raise"):
            raise ShardingError(f"on_miss must be 'gather' or 'raise', got {on_miss!r}")
        self.on_miss = on_miss
        if map_own_chunk not in (True, False, "auto"):
            raise ShardingError(f"map_own_chunk must be True, False or 'auto', got {map_own_chunk!r}")
        #: How the slots are laid out: the communicator's choice for ``map_own_chunk`` (its NCCL
        #: binding's mapped layer views), else plain slots. Asked before anything is declared: a
        #: mapped chunk must be whole pages.
        self.slot_policy: SlotPolicy = comm.slot_policy(map_own_chunk) or plain_slot_policy(comm, map_own_chunk)
        self.lookahead = lookahead
        self.plugins = list(plugins)
        self.trace = trace
        self.keep_initial_weights = keep_initial_weights
        self.verify_replicas = verify_replicas
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
        self.shrunk: set[int] = set()
        #: Every declared block (sharded or not) and its tensors' places by storage: the tie check's index.
        self.declared_blocks: dict[int, tuple[nn.Module, dict[tuple, list[Place]]]] = {}
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
        """Decide layer ``layer_id``'s targets and fix its flat layout (:func:`~wsharding.core.declare.declare_layer`)."""
        return declare_layer(self, layer_id, layer, names)

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
            if keep and self.verify_replicas:  # the full weight, before the shrink: [Note: digest before the shrink]
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
    def finalize(self, observe: Callable[[str, int | None], None] | None = None) -> WeightSharding:
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
            lookahead=self.lookahead,
            trace=self.trace,
            plugins=self.plugins,
            on_miss=self.on_miss,
        )
        for i, layer in self.layers.items():
            layer._weight_shard = (self.planner, i)
        comm.on_close(self.close)  # the communicator closes us before it frees the memory we view
        for ts in self.targets.values():
            for t in ts:
                guard_bound_weight(t)
        # autograd, state_dict() and save_checkpoint refused on the bound weights (wsharding/core/guards.py)
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
        in-place edits of bound weights] in ``wsharding/core/planner.py``) -- after the gathers, so that a
        rank that refuses leaves no peer waiting in one.
        """
        self._expect("finalized", "full_state_dict")
        full: dict[int, torch.Tensor] = {}
        self.planner.lend_slots()  # nothing lands in a slot while these gathers fill them
        for i in sorted(self.targets):
            buf = self.slots.full_buffer(i)
            self.comm.all_gather_into(buf, self.slots.gather_chunk(i, self.chunks[i]), what=f"full_state_dict: layer {i}")
            self.planner.filled(i)
            views = self.layouts[i].views(buf)
            for t in self.targets[i]:
                full[id(t.module.weight)] = views[t.entry].to(device, copy=True)
        refuse_edits(self.planner.versions.edited(), "full_state_dict: ")
        if model is None:
            return {f"{t.layer}.{t.entry}": full[id(t.module.weight)] for ts in self.targets.values() for t in ts}
        with self.guards.reading_state_dict():  # its sharded weights are replaced below
            state = model.state_dict(keep_vars=True)
        return {k: full[id(v)] if id(v) in full else v.detach().to(device, copy=True) for k, v in state.items()}

    @property
    def map_own_chunk_reason(self) -> str:
        """One line: mapped or not, and why."""
        return self.slot_policy.reason


def _refuse(why: str, layer_id: int) -> Callable[..., None]:
    def hook(_mod: nn.Module, _args: Any) -> None:
        raise ShardingError(f"layer {layer_id}: {why}")

    return hook
