"""After finalize: the ordinary uses of a sharded weight that would give silently wrong results, refused.

A sharded weight is a view of one of two gather slots, and the slot is refilled by every gather
into it (see [Note: bound weights] in ``wsharding/core/bound.py`` for ``.to()``, ``load_state_dict``
and a replaced ``weight``, which that module refuses, and [Note: reads of a bound weight] there for
every use of its values outside its linear's forward). Three more uses read or write the slot at the
wrong time:

* **autograd** ([Note: autograd through a bound weight]): refused at the forward that would record it;
* **in-place edits** inside a forward: refused at the layer's next gather ([Note: in-place edits of
  bound weights] in ``wsharding/core/edits.py``; the planner's wait checks, on the hot path);
* **state_dict()**: refused, pointing to :meth:`~wsharding.core.sharding.WeightSharding.full_state_dict`
  (a collective: a state dict read on one rank cannot gather). The refusal stays after ``close()``,
  when the weights hold nothing. :func:`wsharding.checkpoint.save_checkpoint` asks
  :func:`bound_weights` which parameters it must not read.

[Note: autograd through a bound weight]
Under grad mode, a linear whose input requires grad saves its weight for backward -- a slot view,
which the gathers of the next layers overwrite long before backward reads it: the gradients of that
layer's input, and so of every earlier layer, come out wrong (by whole units on a small GPT), with no
error from autograd, whose version check watches the Parameter's counter and a gather writes the slot
buffer. A weight that itself requires grad would also collect a full-size gradient that nothing can
apply (an optimizer step is an in-place edit). So the sharded weights get ``requires_grad=False`` at
finalize (no rank holds them whole: they cannot be trained), and each sharded linear's ``forward`` is
wrapped with one flag check, ``torch.is_grad_enabled()``: false under ``torch.no_grad()`` and
``torch.inference_mode()`` -- the inference path pays that check, one Python call per linear and the
context that lets the forward read its weight ([Note: reads of a bound weight] in
``wsharding/core/bound.py``), no hook, so ``nn.Module.__call__`` keeps its fast path. Under grad mode
the wrapper looks at what the forward would record: an input or the weight that requires grad is
refused, naming the weight and the rank; a plain forward with nothing that requires grad runs.

Why at the forward, not at backward: the forward is the first use that makes a later result wrong,
and the last point at which nothing wrong has been computed -- by backward the slot was refilled and
autograd has nothing to notice. The refusal gives up the step cleanly (the planner joins the gathers
it had issued ahead), so the model stays usable under ``torch.no_grad()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsharding.core import graph_ops
from wsharding.core.bound import raw_access
from wsharding.core.graph_ops import ensure_in_graph, register_planner
from wsharding.core.rowloaders import ShardingError, ShardTarget


@dataclass(frozen=True)
class BoundWeight:
    """One sharded weight of a model, as :func:`bound_weights` reports it."""

    target: ShardTarget
    rank: int
    #: Whether its sharding was closed (the weight then holds 0 elements).
    closed: bool


class BoundWeightGuards:
    """The guards of one finalized sharding's weights: installed by ``finalize``, the forward wrappers
    removed by ``close`` (the state-dict refusal stays: a closed sharding's weights hold nothing)."""

    def __init__(self, ws: Any) -> None:  # the WeightSharding that installs it (sharding.py imports this module)
        # Weakly: the guarded modules hold this object, and a model kept after close() must not keep
        # the sharding's planner (its chunks and slots) alive through it.
        self._ws = weakref.ref(ws)
        self.rank = ws.comm.rank
        self.world_size = ws.comm.world_size
        #: Set by ``close``: the weights hold 0 elements from then on.
        self.closed = False
        self._reading_full = False
        #: ``(module, our wrapper, the instance-level forward it replaced or None)``
        self._wrappers: list[tuple[nn.Module, Callable[..., Any], Callable[..., Any] | None]] = []

    def install(self) -> None:
        """Guard every target of the sharding (idempotent per module)."""
        ws = self._ws()
        for ts in ws.targets.values() if ws is not None else ():
            for t in ts:
                m = t.module
                if getattr(m, "_weight_shard_guard", None) is not None:
                    continue
                m.weight.requires_grad_(False)  # [Note: autograd through a bound weight]
                m._weight_shard_guard = (self, t)
                m.register_state_dict_pre_hook(self._state_dict_hook(t))
                previous = m.__dict__.get("forward")
                self._wrappers.append((m, self._wrap_forward(m, t), previous))

    def on_close(self) -> None:
        """Take the forward wrappers off (the layers refuse to run once closed anyway)."""
        self.closed = True
        for m, fwd, previous in self._wrappers:
            if m.__dict__.get("forward") is fwd:
                if previous is None:
                    del m.forward
                else:
                    m.forward = previous
        self._wrappers.clear()

    @contextmanager
    def reading_state_dict(self) -> Iterator[None]:
        """Let ``state_dict()`` through: ``full_state_dict`` reads the model's keys and replaces the
        sharded weights with the gathered ones."""
        self._reading_full = True
        try:
            yield
        finally:
            self._reading_full = False

    # ---- the guards --------------------------------------------------------------------------------
    def _wrap_forward(self, module: nn.Module, target: ShardTarget) -> Callable[..., Any]:
        """[Note: autograd through a bound weight]: ``module.forward`` behind one grad-mode check."""
        inner = module.forward  # the class's, or an earlier instance-level wrapper (put back at close)
        grad_enabled = torch.is_grad_enabled
        refuse = self._refuse_autograd
        ws = self._ws()
        # [Note: checked at use]: a linear called on its own (outside its block) finds its slot checked too
        ensure, layer = (ws.planner.ensure, target.layer) if ws is not None and ws.planner is not None else (None, 0)
        compute = raw_access  # [Note: reads of a bound weight]: the weight is readable inside the forward only

        key = register_planner(ws.planner) if ensure is not None else 0

        def forward(*args: Any, **kwargs: Any) -> Any:
            if grad_enabled():
                refuse(module, target, args, kwargs)
            if ensure is not None:
                if graph_ops.enabled and torch.compiler.is_compiling():  # [Note: the planner's calls as graph ops]
                    ensure_in_graph(key, layer, args, kwargs)
                else:
                    ensure(layer)
            with compute():
                return inner(*args, **kwargs)

        module.forward = forward
        return forward

    def _refuse_autograd(self, module: nn.Module, target: ShardTarget, args: tuple, kwargs: dict) -> None:
        why = []
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
            why.append("its input requires grad")
        if module.weight.requires_grad:
            why.append("the weight requires grad")
        if not why:
            return  # nothing is recorded: the forward computes exactly as under no_grad
        ws = self._ws()
        planner = ws.planner if ws is not None else None
        if planner is not None:
            planner.abort_step()
        raise ShardingError(
            f"{target.label} on rank {self.rank}: autograd would record this forward ({' and '.join(why)}), "
            "but a sharded weight is a view of a gather slot that the next layers' gathers overwrite before "
            "backward reads it: the gradients through it -- this layer's and every earlier layer's -- would be "
            "silently wrong. A sharded model is for inference: run it under torch.no_grad() or "
            "torch.inference_mode(); to train or fine-tune, use the unsharded model")

    def _state_dict_hook(self, target: ShardTarget) -> Callable[[nn.Module, str, bool], None]:
        def hook(_module: nn.Module, prefix: str, _keep_vars: bool) -> None:
            if self._reading_full:
                return
            where = f"state_dict: {prefix}weight ({target.label}) on rank {self.rank}"
            if self.closed:
                raise ShardingError(
                    f"{where}: its weight sharding was closed (WeightSharding.close(), or its communicator was "
                    "closed) and its sharded weights freed: the parameter holds 0 elements. Take "
                    "WeightSharding.full_state_dict(model) -- on every rank of the shard group -- before close()")
            raise ShardingError(
                f"{where} is sharded: this rank keeps 1/{self.world_size} of it, and the parameter is a "
                "view of a gather slot that holds whichever layer was gathered last. Use "
                "WeightSharding.full_state_dict(model) instead -- a collective: every rank of the shard group "
                "must call it -- and save its result on one rank: save_checkpoint(model, path, state_dict=full)")

        return hook


def bound_weights(model: nn.Module) -> dict[str, BoundWeight]:
    """The sharded weights of ``model`` (finalized or closed), by parameter name."""
    out = {}
    for name, m in model.named_modules():
        guard = getattr(m, "_weight_shard_guard", None)
        if guard is not None:
            guards, target = guard
            out[f"{name}.weight" if name else "weight"] = BoundWeight(target, guards.rank, guards.closed)
    return out
