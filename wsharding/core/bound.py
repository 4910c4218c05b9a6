"""After finalize: a sharded weight is a view of a gather slot -- and must stay one.

[Note: bound weights] The Parameter objects are kept (``model.parameters()``, ``state_dict()`` and
``weight_loader`` still see them), but their ``.data`` is a zero-copy view of the slot that the
planner gathers into before the layer runs. Ordinary operations would silently break that:

* ``model.half()`` / ``model.to(other device or dtype)`` replace ``.data`` with a converted copy: the
  layer would then compute with a stale copy of whatever the slot held, while the gathers go on
  filling the slot;
* ``model.load_state_dict(...)`` copies into ``.data`` -- into the slot -- and the next gather
  overwrites it: the loaded values would be lost without a word;
* ``linear.weight = nn.Parameter(new)`` keeps the forward right (it computes with ``new``), but the
  gathers go on filling the old Parameter's slot and ``full_state_dict`` reads the chunks: the model
  would be saved with the old weight.

So each bound Parameter's class is swapped for a subclass whose ``.data`` setter refuses any tensor
other than the one it has, each target module refuses a state dict that names its weight, and one
parameter-registration hook (torch's, process-wide; it returns at once for any other module)
refuses a new ``weight`` on a sharded linear. The library rebinds through
:func:`wsharding.core.contract.rebind_tensor`, which goes under the guard.

[Note: reads of a bound weight]
Between its layer's computations a sharded weight holds another layer's bytes: the slot is refilled
every step by whichever layer uses it. Everything torch can do with the Parameter other than reading
its metadata -- a copy (``clone``, ``detach().cpu()``, ``tolist``, ``torch.save``, ``deepcopy``), a
computation (``x @ w.t()``, ``weight_norm``), a conversion (``.half()``, ``.to('meta')``), an edit
(``mul_``, ``nn.init``, ``register_parametrization``'s ``set_``) -- goes through the class's
``__torch_function__``, which refuses it naming the weight and the way out
(``WeightSharding.full_state_dict(model)``). Metadata (shape, dtype, device, ``numel``, storage
pointers, ``requires_grad``) is answered, and a conversion that returns the weight itself (``.to()``
to where it already is, ``.float()`` of a float32 weight) is a no-op, so it goes through too.

Inside its linear's forward the weight is the right layer's: the forward wrapper
(``wsharding/core/guards.py``) runs the forward under ``torch._C.DisableTorchFunctionSubclass``, so
torch skips every subclass's ``__torch_function__`` there and ``F.linear`` dispatches exactly as on a
plain Parameter -- no Python call per op on the hot path, only that context per linear. (A tensor
subclass that relies on its own ``__torch_function__`` is therefore not honoured inside a sharded
linear's forward; the weight's own class, a Parameter, has none.) A flag read by
``__torch_function__`` instead would cost a Python call on every op of every linear.

Inside its own block the weight is the right layer's too: the block's start confirmed its slot
([Note: checked at use] in ``wsharding/core/step_owner.py``) and the gate keeps every other gather out
of it until the block ends. A block that reads a target's weight directly (``F.linear(x,
self.fc.weight)``, ``x @ self.fc.weight.t()``) is a real model's code, so there a read runs (at the
cost of one Python call per op): ``__torch_function__`` asks the planner whether the weight's block
is the one computing, on this thread, with its layer in the slot. An edit is refused even there.

``.data`` is a detached alias, which shares the Parameter's version counter (torch's own ``.data``
has a fresh one, so ``w.data.mul_(2)`` would escape the version check of [Note: in-place edits of
bound weights] in ``wsharding/core/edits.py``). Outside the forward the alias is guarded like the
Parameter (its metadata answers, ``w.data = w.data`` is a no-op; reads and edits are refused).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from wsharding.core.rowloaders import ShardingError, ShardTarget

_GUARDED: dict[type, type] = {}

#: Runs torch's own implementation on a bound weight (no ``__torch_function__``): the forward wrapper
#: and the library's raw accesses use it.
raw_access = torch._C.DisableTorchFunctionSubclass

_T = torch.Tensor
#: Answered outside the forward: what a weight is, never what it holds.
_METADATA = frozenset(
    [getattr(_T, n).__get__ for n in (
        "shape", "dtype", "device", "layout", "requires_grad", "grad", "grad_fn", "is_leaf", "_version", "ndim",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "names", "itemsize",
        "nbytes", "output_nr", "retains_grad") if hasattr(_T, n)]
    + [_T.requires_grad.__set__, _T.grad.__set__]
    + [getattr(_T, n) for n in (
        "size", "dim", "ndimension", "numel", "nelement", "element_size", "stride", "storage_offset",
        "is_contiguous", "is_floating_point", "is_complex", "is_signed", "get_device", "data_ptr",
        "untyped_storage", "is_inference", "is_shared", "is_pinned", "requires_grad_",
        "_is_view", "is_same_size", "__len__", "__dir__", "__sizeof__", "is_conj", "is_neg", "_is_zerotensor")
        if hasattr(_T, n)]
    + [torch.numel, torch.is_floating_point, torch.is_complex, torch._has_compatible_shallow_copy_type])
#: Conversions: a no-op when they return the weight itself, refused otherwise.
_CONVERSIONS = frozenset(getattr(_T, n) for n in (
    "to", "cpu", "cuda", "half", "float", "double", "bfloat16", "type", "contiguous"))
_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift"))


def _label(t: torch.Tensor) -> str:
    d = t.__dict__
    return f"{d.get('weight_shard_label', 'a sharded weight')} on rank {d.get('weight_shard_rank', '?')}"


def _bound_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The bound weights (or guarded aliases) among a call's arguments, first found first."""
    found = []
    for a in (*args, *kwargs.values()):
        for b in a if isinstance(a, (list, tuple)) else (a,):
            if getattr(type(b), "slot_bound", False):
                found.append(b)
    if not found:  # pragma: no cover
        raise AssertionError("__torch_function__ of a bound weight called without one")
    return found


#: When a bound weight may be read anyway (its block computes), by ``id`` of the weight: kept beside
#: it, not in its ``__dict__``, which pickling and ``deepcopy`` would copy with the planner it reaches
#: (and not by the tensor itself, whose hash and ``==`` would come back to ``__torch_function__``).
_READS: dict[int, Callable[[], bool]] = {}


def _reads_with(t: torch.Tensor, reads: Callable[[], bool]) -> None:
    if id(t) not in _READS:
        weakref.finalize(t, _READS.pop, id(t), None)
    _READS[id(t)] = reads


def _is_edit(func: Any) -> bool:
    name = (torch.overrides.resolve_name(func) or getattr(func, "__name__", repr(func))).removeprefix("torch.")
    op = name.rpartition(".")[2]
    return op in _IN_PLACE_DUNDERS or op in ("__setitem__", "__set__") or (op.endswith("_") and not op.startswith("_"))


def _readable(t: torch.Tensor) -> bool:
    """Its own block computes now, on this thread, with its layer in the slot ([Note: reads of a bound weight])."""
    reads = _READS.get(id(t))
    return reads is not None and reads()


def _refuse_use(t: torch.Tensor, func: Any, converted: torch.Tensor | None = None) -> ShardingError:
    """[Note: reads of a bound weight]: the refusal of ``func`` on ``t`` outside its linear's forward."""
    if torch.compiler.is_exporting():  # torch.export reads every parameter before the forward runs
        from wsharding.core.planner import EXPORT_REFUSED

        return ShardingError(f"{_label(t)}: {EXPORT_REFUSED}")
    name = (torch.overrides.resolve_name(func) or getattr(func, "__name__", repr(func))).removeprefix("torch.")
    if converted is not None:
        with raw_access():
            was, now = f"{t.dtype} on {t.device}", f"{converted.dtype} on {converted.device}"
        d = t.__dict__
        return ShardingError(
            f"{d.get('weight_shard_label', 'a sharded weight')} is a view of a weight-sharding slot after finalize, on "
            f"rank {d.get('weight_shard_rank', '?')}: {name} ({was} -> {now}) would copy whichever layer the slot "
            "holds now -- every step refills it -- and a module converted so would compute with a stale copy while "
            "the gathers go on filling the slot. Convert dtype and device (.to(), .half()) before WeightSharding "
            "declares the model; to read the weights, take WeightSharding.full_state_dict(model) on every rank of "
            "the shard group")
    edit = _is_edit(func)
    harm = ("the edit would land in those bytes, and the next gather of its layer would undo it" if edit else
            "a copy, print, save or computation would get those bytes, not this weight, without a word")
    return ShardingError(
        f"{_label(t)}: {name} outside its linear's forward. After finalize a sharded weight is a view of a "
        "weight-sharding slot that every step refills with whichever layer uses it, so between its layer's "
        f"computations it holds another layer's bytes: {harm}. To read or save the weights, take "
        "WeightSharding.full_state_dict(model) -- a collective: every rank of the shard group calls it; to compute "
        "with a weight, call its linear (or read it in its own block's forward, while the sharded model runs that "
        "block); convert, initialize, re-parametrize or load the model before it is sharded")


# [Note: storage-level reads of a bound weight]
# ``w.untyped_storage()`` is metadata for most callers (its ``data_ptr``, ``nbytes``: safetensors and
# transformers find shared tensors so), but the storage object also reads and copies the bytes --
# ``tolist``, indexing, ``cpu``, ``clone``, pickling, ``torch.empty(0).set_(storage)`` -- and a bound
# weight's storage is its slot: whichever layer was gathered last. So outside the forward the storage
# comes back as a :class:`SlotStorage`: the same storage (torch keeps one Python object per storage,
# so every view of the slot answers with it from then on), whose metadata answers and whose every
# read, copy or edit of bytes is refused -- ``Tensor.set_`` with it as the source too (wrapped once
# per process). Inside the forward (torch functions off: ``raw_access``) it reads as any storage.
# ``storage()`` and ``_typed_storage()`` (deprecated TypedStorage views, which torch's serialization
# writes byte for byte) are refused outright. A raw address (``data_ptr()`` into ctypes) is beyond
# any guard: it is the caller's own memory access.
_STORAGE_READS = frozenset(n for n in (
    "__copy__", "__deepcopy__", "__delitem__", "__getitem__", "__getstate__", "__iter__", "__reduce__",
    "__reduce_ex__", "__setitem__", "_byteswap", "_resize_with_addr_", "_set_cdata", "_set_from_file", "_share_cuda_",
    "_share_fd_cpu_", "_share_filename_cpu_", "_swap_data_ptr_", "_to", "_write_file", "bfloat16", "bool", "byte",
    "byteswap", "char", "clone", "complex_double", "complex_float", "copy_", "cpu", "cuda", "double", "fill_", "float",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "half", "hpu", "int", "long", "mps",
    "pin_memory", "resize_", "share_memory_", "short", "to", "tolist", "type") if hasattr(torch.UntypedStorage, n))


def _storage_refusal(what: str) -> ShardingError:
    return ShardingError(
        f"{what} of a sharded weight's storage outside its linear's forward: after finalize the storage is a "
        "weight-sharding slot that every step refills with whichever layer uses it, so its bytes are another "
        "layer's, not this weight. Its metadata (data_ptr, nbytes) answers; to read or save the weights, take "
        "WeightSharding.full_state_dict(model) -- a collective: every rank of the shard group calls it")


def _storage_method(name: str) -> Callable[..., Any]:
    inner = getattr(torch.UntypedStorage, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch._C._is_torch_function_enabled():
            raise _storage_refusal(f"UntypedStorage.{name}")
        return inner(self, *args, **kwargs)

    return method


def _storage_repr(self: Any) -> str:
    return (f"SlotStorage(a weight-sharding slot's storage, {torch.UntypedStorage.nbytes(self)} bytes on "
            f"{torch.UntypedStorage.device.__get__(self)}: its bytes are whichever layer was gathered last)")


#: The storage of a bound weight outside its linear's forward ([Note: storage-level reads of a bound weight]).
SlotStorage = type("SlotStorage", (torch.UntypedStorage,), {
    **{n: _storage_method(n) for n in _STORAGE_READS}, "__repr__": _storage_repr, "__str__": _storage_repr,
    "__format__": lambda self, spec: format(_storage_repr(self), spec), "__module__": __name__,
    "__doc__": "A weight-sharding slot's storage: metadata answered, bytes refused outside the forward."})

_TYPED_STORAGE = frozenset(getattr(_T, n) for n in ("storage", "_typed_storage") if hasattr(_T, n))
_PLAIN_SET: list[Any] = []


def _is_slot_storage(a: object) -> bool:
    """A :class:`SlotStorage`, or a TypedStorage over one."""
    return isinstance(a, SlotStorage) or isinstance(getattr(a, "_untyped_storage", None), SlotStorage)


def _typed_storage(self: torch.Tensor) -> Any:
    """``Tensor._typed_storage`` (torch's internal TypedStorage view, not dispatched to
    ``__torch_function__``): refused outside the forward ([Note: storage-level reads of a bound weight])."""
    if torch._C._is_torch_function_enabled() and not _readable(self):
        raise _storage_refusal("Tensor._typed_storage()")
    return torch.Tensor._typed_storage(self)


def _refuse_slot_storage_source() -> None:
    """Wrap ``torch.Tensor.set_`` once: a :class:`SlotStorage` as the source is refused outside the forward."""
    if _PLAIN_SET:
        return
    inner = torch.Tensor.set_
    _PLAIN_SET.append(inner)

    @functools.wraps(inner)
    def set_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch._C._is_torch_function_enabled() and any(map(_is_slot_storage, (*args, *kwargs.values()))):
            raise _storage_refusal("Tensor.set_ from the storage")
        return inner(self, *args, **kwargs)

    torch.Tensor.set_ = set_  # type: ignore[method-assign]


def _torch_function(cls: type, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
    """[Note: reads of a bound weight]: metadata answered, a no-op conversion returned, a read inside
    the weight's own block run, the rest refused (never called inside a sharded linear's forward)."""
    kwargs = kwargs or {}
    if func in _METADATA:
        with raw_access():
            out = func(*args, **kwargs)
        if func is _T.untyped_storage and type(out) is torch.UntypedStorage:
            out.__class__ = SlotStorage  # [Note: storage-level reads of a bound weight]
        return out
    if func in _TYPED_STORAGE and not all(map(_readable, _bound_in(args, kwargs))):
        raise _storage_refusal(f"Tensor.{func.__name__}()")
    bound = _bound_in(args, kwargs)
    if all(map(_readable, bound)) and not _is_edit(func):
        with raw_access():
            return func(*args, **kwargs)
    t = next((b for b in bound if not _readable(b)), bound[0])
    converted = None
    if func in _CONVERSIONS:
        with raw_access():
            out = func(*args, **kwargs)
        if out is t or not isinstance(out, torch.Tensor):
            return out  # the weight itself (already there), or a type name
        converted = out
    raise _refuse_use(t, func, converted)


def _repr(self: torch.Tensor) -> str:
    with raw_access():
        shape, dtype, device = list(self.shape), self.dtype, self.device
    return (f"{type(self).__name__}({_label(self)}, {shape}, {dtype}, {device}: a view of a weight-sharding slot; "
            "its values: WeightSharding.full_state_dict(model))")


def _format(self: torch.Tensor, spec: str) -> str:
    return format(_repr(self), spec)


def _set_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.set_`` skips ``__torch_function__`` (torch dispatches it directly): refused here."""
    if torch._C._is_torch_function_enabled():
        raise _refuse_use(self, torch.Tensor.set_)
    return torch._C.TensorBase.set_(self, *args, **kwargs)


#: What ``.data`` of a bound weight is outside its linear's forward: a detached alias (it shares the
#: version counter) with the same guard.
SlotBoundData = type("SlotBoundData", (torch.Tensor,), {
    "__torch_function__": classmethod(_torch_function), "__repr__": _repr, "__format__": _format, "set_": _set_,
    "_typed_storage": _typed_storage, "slot_bound": True, "__module__": __name__,
    "__doc__": "The .data of a bound weight outside its linear's forward (see [Note: reads of a bound weight]).",
})


def _get_data(self: torch.Tensor) -> torch.Tensor:
    if not torch._C._is_torch_function_enabled():  # inside its linear's forward ([Note: reads of a bound weight])
        return torch._C.TensorBase.detach(self)  # shares the version counter: an edit is found at the next wait
    with raw_access():
        alias = torch.Tensor._make_subclass(SlotBoundData, torch._C.TensorBase.detach(self))
    alias.__dict__.update(weight_shard_label=self.__dict__.get("weight_shard_label"),
                          weight_shard_rank=self.__dict__.get("weight_shard_rank"))
    if id(self) in _READS:
        _reads_with(alias, _READS[id(self)])
    return alias


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    with raw_access():
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
    """The subclass of ``cls`` whose ``.data`` setter refuses a different tensor and whose values are
    refused outside its linear's forward (made once per class)."""
    if cls not in _GUARDED:
        if cls in _GUARDED.values():
            return cls
        _GUARDED[cls] = type(f"SlotBound{cls.__name__}", (cls,), {
            "data": property(_get_data, _set_data),
            "__torch_function__": classmethod(_torch_function),
            "__repr__": _repr,
            "__format__": _format,
            "set_": _set_,
            "_typed_storage": _typed_storage,
            "slot_bound": True,
            "__module__": __name__,
            "__doc__": f"A {cls.__name__} bound to a weight-sharding slot (see [Note: bound weights]).",
        })
    return _GUARDED[cls]


def _state_dict_refusal(name: str, label: str) -> ShardingError:
    return ShardingError(
        f"load_state_dict: {name} ({label}) is sharded and bound to a slot; a copy into it would be overwritten by "
        "the next gather. Load checkpoints before finalize (wsharding.checkpoint.load_checkpoint), or into the "
        "unsharded model. Nothing of the model was changed")


def _refuse_state_dict(target: ShardTarget):
    def hook(module, state_dict, prefix, *args, **kwargs):
        if prefix + "weight" in state_dict:
            raise _state_dict_refusal(prefix + "weight", target.label)
    return hook


# [Note: refused before anything changes]
# ``model.half()`` walks the modules in order and converts each one's tensors: the guard of a bound
# weight refuses when the walk reaches it, and every module before it -- an embedding, a norm, the
# blocks left replicated -- stays converted: a model half in fp16 whose next step is off without a
# word. ``model.load_state_dict(sd)`` likewise copies module by module until a sharded linear's hook
# refuses. So both are checked at the call on the module the user called them on, before torch
# changes anything: ``Module._apply`` (behind ``.to``, ``.half``, ``.float``, ``.double``,
# ``.bfloat16``, ``.type``, ``.cuda``, ``.cpu``, ``.to_empty``, ``share_memory``) first applies its
# conversion to each bound weight below it -- a conversion that is a no-op returns the weight itself,
# any other is refused by the weight's own guard -- and ``load_state_dict`` first looks for a key of
# a bound weight. Both are torch's methods wrapped once per process, at the first finalize; the
# outermost ``_apply`` of a call (a thread-local flag) looks at its bound weights, nested ones do not.
_OUTER = threading.local()
_MODULE_PATCHES: list[tuple[str, Any]] = []


def _bound_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in module.named_parameters() if getattr(type(p), "slot_bound", False)]


def _checked_apply(inner: Callable[..., Any]) -> Callable[..., Any]:
    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], Any], *args: Any, **kwargs: Any) -> Any:
        if getattr(_OUTER, "applying", False):
            return inner(self, fn, *args, **kwargs)
        for _, p in _bound_parameters(self):  # [Note: refused before anything changes]
            fn(p)  # the weight itself for a no-op conversion; refused (ShardingError) otherwise
        _OUTER.applying = True
        try:
            return inner(self, fn, *args, **kwargs)
        finally:
            _OUTER.applying = False

    return _apply


def _checked_load_state_dict(inner: Callable[..., Any]) -> Callable[..., Any]:
    def load_state_dict(self: nn.Module, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        for name, p in _bound_parameters(self):  # [Note: refused before anything changes]
            if name in state_dict:
                raise _state_dict_refusal(name, p.__dict__.get("weight_shard_label", "a sharded weight"))
        return inner(self, state_dict, *args, **kwargs)

    return load_state_dict


def _check_module_calls_first() -> None:
    """Wrap ``nn.Module._apply`` and ``nn.Module.load_state_dict`` once ([Note: refused before anything changes])."""
    if _MODULE_PATCHES:
        return
    for name, wrap in (("_apply", _checked_apply), ("load_state_dict", _checked_load_state_dict)):
        inner = getattr(nn.Module, name)
        _MODULE_PATCHES.append((name, inner))
        setattr(nn.Module, name, functools.wraps(inner)(wrap(inner)))


def bound_parameter(module: nn.Module) -> torch.Tensor | None:
    """The Parameter that finalize bound to ``module``'s slot (None for a module that is not a target)."""
    ref = module.__dict__.get("_weight_shard_bound")
    return ref() if ref is not None else None


def _refuse_new_weight(module: nn.Module, name: str, param: torch.Tensor) -> None:
    """torch's parameter-registration hook: a sharded linear keeps its bound ``weight``."""
    if name != "weight" or "_weight_shard_bound" not in module.__dict__:
        return
    bound = bound_parameter(module)
    if param is bound:
        return  # ``linear.weight = linear.weight``
    raise ShardingError(
        f"{_label(bound) if bound is not None else 'a sharded weight'}: a new {type(param).__name__} assigned as the "
        "weight of its sharded linear after finalize. The linear's weight must stay the Parameter bound to its "
        "weight-sharding slot: the gathers fill that slot and WeightSharding.full_state_dict reads the resident "
        "chunks, so the model would be saved with the old weight without a word. Assign or load weights before "
        "finalize; to change a sharded model's weights, take WeightSharding.full_state_dict(model) on every rank of "
        "the shard group, change the copy and load it into a freshly built model that you shard again")


_REGISTRATION_HOOK: list[Any] = []


def guard_bound_weight(target: ShardTarget, rank: int, reads: Callable[[], bool] | None = None) -> None:
    """Make ``target``'s weight refuse ``.data`` replacement, ``load_state_dict``, its replacement by
    another Parameter and any use of its values outside its linear's forward (idempotent). ``reads``
    says when its values may be read anyway: while its own block computes with them."""
    p = target.module.weight
    if isinstance(p, nn.Parameter):
        p.__class__ = guarded_class(type(p))
    p.weight_shard_label = target.label
    p.weight_shard_rank = rank
    if reads is not None:
        _reads_with(p, reads)
    target.module.__dict__["_weight_shard_bound"] = weakref.ref(p)  # not a registered attribute
    if not _REGISTRATION_HOOK:
        _REGISTRATION_HOOK.append(nn.modules.module.register_module_parameter_registration_hook(_refuse_new_weight))
    _check_module_calls_first()
    _refuse_slot_storage_source()
    if not getattr(target.module, "_weight_shard_state_dict_guard", False):
        target.module.register_load_state_dict_pre_hook(_refuse_state_dict(target))
        target.module._weight_shard_state_dict_guard = True
