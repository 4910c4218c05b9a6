"""After finalize: a sharded weight is a view of a gather slot -- and must stay one.

[Note: bound weights] The Parameter objects are kept (``model.parameters()``, ``state_dict()`` and
``weight_loader`` still see them), but their ``.data`` is a zero-copy view of the slot that the
planner gathers into before the layer runs. Two ordinary operations would silently break that:

* ``model.half()`` / ``model.to(other device or dtype)`` replace ``.data`` with a converted copy: the
  layer would then compute with a stale copy of whatever the slot held, while the gathers go on
  filling the slot;
* ``model.load_state_dict(...)`` copies into ``.data`` -- into the slot -- and the next gather
  overwrites it: the loaded values would be lost without a word.

So each bound Parameter's class is swapped for a subclass whose ``.data`` setter refuses any tensor
other than the one it has (and whose getter hands out an alias that shares its version counter, so an
in-place edit through ``.data`` is seen like any other), and each target module refuses a state dict
that names its weight. The
library rebinds through :func:`wsharding.core.contract.rebind_tensor`, which goes under the guard.
"""

from __future__ import annotations

import torch
from torch import nn

from wsharding.core.rowloaders import ShardingError, ShardTarget

_GUARDED: dict[type, type] = {}


def _get_data(self: torch.Tensor) -> torch.Tensor:
    # ``.data`` would hand out an alias with a version counter of its own, so ``w.data.mul_(2)`` would
    # edit the slot unseen by the check of in-place edits ([Note: in-place edits of bound weights]);
    # ``detach()`` is the same alias sharing the Parameter's counter: the edit is refused at the next use.
    return self.detach()


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    cur = torch._C.TensorBase.data.__get__(self)
    same = (value.data_ptr() == cur.data_ptr() and value.dtype == cur.dtype and value.shape == cur.shape
            and value.device == cur.device)
    if not same:
        raise ShardingError(
            f"{getattr(self, 'weight_shard_label', 'a sharded weight')} is a view of a weight-sharding slot after "
            f"finalize; replacing its data ({cur.dtype} on {cur.device} -> {value.dtype} on {value.device}) would "
            "detach it from the slot and the layer would compute with a stale copy. Convert dtype and device "
            "(.to(), .half()) before WeightSharding declares the model, and load checkpoints before finalize."
        )


def guarded_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``.data`` setter refuses a different tensor (made once per class)."""
    if cls not in _GUARDED:
        if cls in _GUARDED.values():
            return cls
        _GUARDED[cls] = type(f"SlotBound{cls.__name__}", (cls,), {
            "data": property(_get_data, _set_data),
            "__module__": __name__,
            "__doc__": f"A {cls.__name__} bound to a weight-sharding slot (see [Note: bound weights]).",
        })
    return _GUARDED[cls]


def _refuse_state_dict(target: ShardTarget):
    def hook(module, state_dict, prefix, *args, **kwargs):
        if prefix + "weight" in state_dict:
            raise ShardingError(
                f"load_state_dict: {prefix}weight ({target.label}) is sharded and bound to a slot; a copy into it "
                "would be overwritten by the next gather. Load checkpoints before finalize "
                "(wsharding.checkpoint.load_checkpoint), or into the unsharded model."
            )
    return hook


def guard_bound_weight(target: ShardTarget) -> None:
    """Make ``target``'s weight refuse ``.data`` replacement and ``load_state_dict`` (idempotent)."""
    p = target.module.weight
    if isinstance(p, nn.Parameter):
        p.__class__ = guarded_class(type(p))
    p.weight_shard_label = target.label
    if not getattr(target.module, "_weight_shard_state_dict_guard", False):
        target.module.register_load_state_dict_pre_hook(_refuse_state_dict(target))
        target.module._weight_shard_state_dict_guard = True
