"""Checkpoints in safetensors: save a replicated model, load into a (sharded) model row range by row range.

A checkpoint stores weights as the original model does: separate ``q_proj`` / ``k_proj`` / ``v_proj``
and ``gate_proj`` / ``up_proj`` tensors (weights and their scales), which the merged linears load by
shard id. Loading calls each parameter's ``weight_loader``: the linear's own (v1/v2) for replicated
weights, and the loader weight sharding installs on its targets. That loader is handed a lazy tensor
(:mod:`wsharding.safetensors_file`), so a rank reads only its own rows of a sharded weight from the
file -- ``bytes_read`` in the result proves it. Then every linear that is not a sharding target runs
its ``process_weights_after_loading`` (targets run it at finalize, on the gathered full weight).

A Hugging Face folder (``save_pretrained``: ``model.safetensors`` or an index) loads the same way: its
keys are the model's parameter names. Every problem is reported with the tensor's name: a missing
tensor, an unexpected one, a wrong shape or dtype.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from wsharding.core.comm import Communicator
from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.core.guards import bound_weights
from wsharding.core.rowloaders import CheckpointShapeError, check_dtype
from wsharding.core.runner import check_shard_blocks_args, shard_blocks
from wsharding.core.sharding import FullShapeLoader, RowShardLoader, ShardingError, WeightSharding, abandon_sharding
from wsharding.empty_build import empty_parameters, materialize
from wsharding.linear.base import process_weights
from wsharding.linear.loading import check_scale_values
from wsharding.linear.parameters import QuantScale
from wsharding.memory import map_large_allocations, trim_host_heap
from wsharding.runtime import in_ci
from wsharding.safetensors_file import Checkpoint, SafetensorsError

#: merged module -> the checkpoint modules it is loaded from, with their shard ids
STACKED: dict[str, list[tuple[str, Any]]] = {
    "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
}


class CheckpointError(WshardingError, ValueError):
    """A checkpoint that does not fit the model: names the tensor and what is wrong."""


def checkpoint_layout(model: nn.Module) -> Iterator[tuple[str, str, Any]]:
    """``(checkpoint key, parameter name, shard id)`` for every tensor the model loads. Only the
    package's merged linears (``row_sub_blocks``) are split into their checkpoint tensors: a plain
    ``nn.Linear`` named ``gate_up_proj`` is one tensor in its checkpoint (Phi-3's is)."""
    modules = dict(model.named_modules())
    for name in sorted(n for n, _ in model.named_parameters()):
        module_path, _, leaf = name.rpartition(".")
        parent, _, mod_name = module_path.rpartition(".")
        if mod_name in STACKED and hasattr(modules.get(module_path), "row_sub_blocks"):
            for ckpt_mod, shard_id in STACKED[mod_name]:
                yield f"{parent + '.' if parent else ''}{ckpt_mod}.{leaf}", name, shard_id
        else:
            yield name, name, None


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``model.state_dict()`` holds (persistent ones), by name; a buffer shared between
    modules once, under its first name (as ``named_parameters`` names a tied parameter)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mname, m in model.named_modules():
        for bname, b in m._buffers.items():
            if b is None or bname in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out[f"{mname}.{bname}" if mname else bname] = b
    return out


def tied_names(model: nn.Module) -> dict[str, str]:
    """Every other name of a tied parameter or persistent buffer (``head.weight`` tied to
    ``embed.weight``) -> the name it is saved and loaded under (its first)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False)]
    for mname, m in model.named_modules(remove_duplicate=False):
        named += [(f"{mname}.{n}" if mname else n, b) for n, b in m._buffers.items()
                  if b is not None and n not in m._non_persistent_buffers_set]
    for name, t in named:
        if id(t) in first:
            if first[id(t)] != name:
                out[name] = first[id(t)]
        else:
            first[id(t)] = name
    return out


def _load_buffer(buf: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """A persistent buffer: the same shape; float to float converted as ``.to`` does, any other dtype
    change refused (an int buffer holds indices or counts, which a conversion would change)."""
    if tuple(tensor.shape) != tuple(buf.shape):
        raise CheckpointError(f"buffer {name}: shape {list(tensor.shape)} does not match the buffer's {list(buf.shape)}")
    if tensor.dtype != buf.dtype and not (tensor.dtype.is_floating_point and buf.dtype.is_floating_point):
        raise CheckpointError(f"buffer {name}: the checkpoint's tensor is {tensor.dtype}, the buffer is {buf.dtype}: "
                              "only float to float is converted")
    buf.copy_(tensor)


def _shard_piece(module: nn.Module, param: torch.Tensor, value: torch.Tensor, shard_id: Any) -> torch.Tensor:
    """The part of merged parameter ``param`` (its ``value``) that checkpoint sub-tensor ``shard_id`` holds."""
    blocks = {b[0]: b for b in module.row_sub_blocks()}
    index = list(blocks).index(shard_id)
    _, offset, rows, _ = blocks[shard_id]
    dim = getattr(param, "output_dim", 0)
    if dim is None:  # one scale per shard (a processed one holds the same value for all)
        return (value.reshape(-1)[0] if value.numel() == 1 else value.reshape(-1)[index]).reshape(())
    physical = getattr(param, "physical", lambda _d, n: n)
    return value.narrow(dim, physical(dim, offset), physical(dim, rows))


def save_checkpoint(model: nn.Module, path: str | Path, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write a replicated (tp 1) model's weights and persistent buffers (everything its ``state_dict()``
    holds, tied tensors once) as a safetensors file, merged parameters split back into their
    checkpoint tensors.

    ``state_dict``: tensors to write instead of the parameters' own values. A sharded model (after
    finalize) holds none of its sharded weights whole -- each is a view of a gather slot -- so it is
    saved from :meth:`wsharding.core.sharding.WeightSharding.full_state_dict`, a collective that every rank
    of the shard group calls, and written by one rank::

        full = ws.full_state_dict(model)          # every rank
        if rank == 0:
            save_checkpoint(model, path, state_dict=full)

    Without a full weight for every sharded parameter it raises :class:`CheckpointError` at once,
    before anything is written and with no collective. It is not collective itself: the usual
    ``if rank == 0: save_checkpoint(...)`` would then leave rank 0 in gathers that the other ranks
    never join (or that their next forward's gathers silently match).
    """
    params = dict(model.named_parameters())
    values = dict(state_dict) if state_dict is not None else {}
    _refuse_bound_weights(model, params, values, state_dict is not None)
    out: dict[str, torch.Tensor] = {}
    for key, pname, shard_id in checkpoint_layout(model):
        p = values.get(pname, params[pname]).detach()
        module = model.get_submodule(pname.rpartition(".")[0])
        if shard_id is not None:
            if getattr(module, "tp_size", 1) != 1:
                raise CheckpointError(f"{pname}: only models built with tp 1 can be saved as full checkpoints")
            p = _shard_piece(module, params[pname], p, shard_id)
        out[key] = p.contiguous().cpu()
    # Persistent buffers are state too (what model.state_dict() holds besides the parameters): a round
    # trip through the file keeps them, bit for bit.
    for name, b in persistent_buffers(model).items():
        out[name] = values.get(name, b).detach().contiguous().cpu()
    save_file(out, str(path))


def _refuse_bound_weights(model: nn.Module, params: dict[str, torch.Tensor], values: dict[str, torch.Tensor],
                          given: bool) -> None:
    """Raise :class:`CheckpointError` unless ``values`` holds the full weight of every sharded
    parameter of ``model`` (see :func:`save_checkpoint`)."""
    recipe = ("Gather the full weights first -- a collective: every rank of the shard group must call it -- then "
              "write them on one rank:\n    full = ws.full_state_dict(model)   # ws: the model's WeightSharding\n"
              "    if rank == 0: save_checkpoint(model, path, state_dict=full)")
    for pname, b in bound_weights(model).items():
        value = values.get(pname)
        head = f"save_checkpoint: {pname} ({b.target.label}) is sharded: on rank {b.rank}"
        if value is not None and tuple(value.shape) == b.target.shape and not _shares_storage(value, params[pname]):
            continue
        if b.closed:
            raise CheckpointError(
                f"{head} its weight sharding was closed and its sharded weights freed (the parameter holds 0 "
                "elements). Take full = ws.full_state_dict(model) on every rank of the shard group before close(), "
                "and save that: save_checkpoint(model, path, state_dict=full) on one rank")
        if not given:
            raise CheckpointError(f"{head} the parameter is a view of a gather slot, not the weight (this rank keeps "
                                  f"only its chunk). {recipe}")
        if value is None:
            raise CheckpointError(f"{head} the parameter is a view of a gather slot, and state_dict has no {pname!r}. "
                                  "Pass full = ws.full_state_dict(model), keyed by parameter name (without the model, "
                                  "full_state_dict() is keyed by layer id)")
        what = ("the parameter itself (a view of a gather slot)" if _shares_storage(value, params[pname])
                else f"{list(value.shape)}, the full weight is {list(b.target.shape)}")
        raise CheckpointError(f"{head} state_dict[{pname!r}] is {what}. {recipe}")


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    ptr = b.untyped_storage().data_ptr()
    return ptr != 0 and a.untyped_storage().data_ptr() == ptr


def show_progress(rank: int | None = None) -> bool:
    """Progress bars only on rank 0, only on a terminal, never in CI logs."""
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    return rank == 0 and not in_ci() and sys.stderr.isatty()


def load_checkpoint(model: nn.Module, path: str | Path, *, strict: bool = True, process: bool = True,
                    progress: bool | None = None) -> dict[str, int]:
    """Load ``path`` (a safetensors file, or a folder as ``save_pretrained`` writes it) into ``model``
    through each parameter's weight loader, then (``process``) run the after-loading step of every
    linear that is not a sharding target.

    Returns ``{"tensors", "row_shard_tensors", "bytes_read", "sharded_bytes_read", "skipped_tensors",
    "buffers", "buffers_kept", "tied_tensors"}``: sharded weights account for ``sharded_bytes_read``,
    exactly this rank's rows; ``skipped_tensors`` counts the checkpoint's tensors the model does not
    know, left unread (only with ``strict=False``). Persistent buffers (what ``state_dict()`` holds
    besides the parameters) are loaded too (``buffers``); one the checkpoint lacks is an error with
    ``strict``, kept as built without (``buffers_kept``). A tied tensor's other name in the checkpoint
    (``tied_tensors``) must hold the same bytes as its first, or the load is refused.
    Raises :class:`CheckpointError` naming the tensor when one is missing, unexpected (with
    ``strict``), misshapen or of a dtype that cannot be converted, and naming the index when a
    quantization scale is NaN, +-inf, negative, or 0 where its format has no zero
    (:func:`wsharding.linear.loading.check_scale_values`). Weight values are not checked: a float
    weight (or a quantized code) that is NaN or inf is loaded as it is.

    ``strict=False`` skips only the checkpoint's extra tensors. Unlike ``load_state_dict(strict=False)``
    it never leaves a parameter unloaded: a tensor the model needs and the checkpoint lacks is still an
    error (a sharded weight's rows would be zeros, and its peers would shard them).

    A float tensor loads into a float parameter of another dtype converted as ``tensor.to(dtype)``
    converts it (an F16 checkpoint into F32 weights); quantized bytes (FP8, integers) never convert
    (:func:`wsharding.core.rowloaders.check_dtype`). ``progress``: a tqdm bar (default: :func:`show_progress`).
    """
    params = dict(model.named_parameters())
    plan = list(checkpoint_layout(model))
    buffers = persistent_buffers(model)
    ties = tied_names(model)
    counts = {"tensors": 0, "row_shard_tensors": 0, "bytes_read": 0, "sharded_bytes_read": 0, "skipped_tensors": 0,
              "buffers": 0, "buffers_kept": 0, "tied_tensors": 0}
    try:
        ckpt = Checkpoint(path)
    except (SafetensorsError, OSError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from e
    with ckpt:
        keys = set(ckpt.keys())
        missing = [k for k, _, _ in plan if k not in keys]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            lenient = "" if strict else " (strict=False skips only the checkpoint's extra tensors, never the model's)"
            raise CheckpointError(
                f"checkpoint {path} is missing tensor(s) {missing[:3]}{more} needed by the model; "
                f"was it written for another model or preset?{lenient}"
            )
        absent = [b for b in buffers if b not in keys]
        if strict and absent:
            more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
            raise CheckpointError(
                f"checkpoint {path} is missing persistent buffer(s) {absent[:3]}{more} of the model (its state_dict "
                "holds them); pass strict=False to keep the values the model was built with")
        counts["buffers_kept"] = len(absent)
        # A tied tensor's other name (head.weight tied to embed.weight) is the model's too: the checkpoint's
        # tensor under it must hold what the model loads under the first name, else one of the two would be
        # ignored without a word (with strict=False, or as "unknown" with strict=True).
        for alias in sorted(k for k in keys if k in ties):
            first = ties[alias]
            if first in keys:
                a, b = ckpt.get(alias).read(), ckpt.get(first).read()
                if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(-1).view(torch.uint8),
                                                                              b.view(-1).view(torch.uint8)):
                    raise CheckpointError(
                        f"checkpoint {path}: {alias!r} and {first!r} are one tensor in the model (tied), and the "
                        f"checkpoint holds different values for them ({a.dtype} {list(a.shape)} vs {b.dtype} "
                        f"{list(b.shape)}): loading one would silently drop the other. Untie them in the model, or "
                        "write a checkpoint where they agree")
                counts["tied_tensors"] += 1
        unexpected = sorted(keys - {k for k, _, _ in plan} - set(buffers) - set(ties))
        if strict and unexpected:
            more = f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else ""
            raise CheckpointError(f"checkpoint {path} has tensor(s) the model does not know: {unexpected[:3]}{more}; "
                                  "check the model matches the checkpoint, or pass strict=False to leave them unread")
        counts["skipped_tensors"] = len(unexpected)  # never read: the plan lists only the model's tensors
        bar = _progress(plan, f"loading {Path(path).name}", show_progress() if progress is None else progress)
        for key, pname, shard_id in bar:
            param = params[pname]
            loader = getattr(param, "weight_loader", None)
            lazy = ckpt.get(key)
            before = ckpt.bytes_read
            try:
                if isinstance(loader, (RowShardLoader, FullShapeLoader)):
                    loader(param, lazy, shard_id)  # reads only what this rank keeps
                    counts["row_shard_tensors"] += isinstance(loader, RowShardLoader)
                    counts["sharded_bytes_read"] += ckpt.bytes_read - before
                else:
                    if param.is_meta:
                        raise CheckpointError(f"parameter {pname} is on the meta device: load_checkpoint fills "
                                              "parameters that have memory; give them memory first "
                                              "(wsharding.empty_build.materialize(model, device)), or shard and "
                                              "load the model with load_sharded, which does")
                    tensor = lazy.read()
                    if isinstance(param, QuantScale):
                        # before the loader copies it and before any requant uses it: a NaN or inf scale
                        # came out of the requant as 1.0, silently ([Note: checkpoint scales are finite]
                        # in wsharding/linear/loading.py); checked here, on the CPU copy just read
                        # and a finite one that overflows where it is applied: to the layer's FP8 weight, in
                        # its compute dtype
                        owner = model.get_submodule(pname.rpartition(".")[0])
                        weight = getattr(owner, "weight", None)
                        compute = getattr(owner, "params_dtype", torch.float32)
                        check_scale_values(tensor, key, zero_allowed=param.zero_allowed, dtype=param.dtype,
                                           error=CheckpointError,
                                           codes=weight.dtype if isinstance(weight, torch.Tensor) else None,
                                           into=compute if compute.is_floating_point else torch.float32)
                    tensor = tensor.to(param.device)
                    if loader is None:
                        _default_loader(param, tensor, pname)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
            except CheckpointError:
                raise
            except (ShardingError, CheckpointShapeError, SafetensorsError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"checkpoint tensor {key!r} (for parameter {pname}) cannot be loaded: {e}") from e
            counts["tensors"] += 1
        for name, buf in buffers.items():
            if name in keys:
                try:
                    _load_buffer(buf, ckpt.get(name).read().to(buf.device), name)
                except (SafetensorsError, RuntimeError) as e:
                    raise CheckpointError(f"checkpoint tensor {name!r} (for buffer {name}) cannot be loaded: {e}") from e
                counts["buffers"] += 1
        counts["bytes_read"] = ckpt.bytes_read
    if process:
        process_weights(model)
    return counts


def _progress(items: list, desc: str, show: bool):
    """A tqdm bar over ``items`` when ``show`` (tqdm is a dependency; a machine without it, such as an
    offline GPU box set up before it was added, loads without a bar)."""
    if not show:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="tensor")


def _default_loader(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """A parameter without a weight loader (an embedding, a norm, a plain ``nn.Linear`` left
    replicated): the same shape, and the dtype rule of every loader (float to float converted as
    ``.to`` does, integers or FP8 into floats refused)."""
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(f"shape {list(tensor.shape)} does not match the parameter's {list(param.shape)}")
    check_dtype(param, tensor.dtype, name=name)
    param.data.copy_(tensor)


def load_sharded(model: nn.Module | Callable[[], nn.Module], path: str | Path, blocks: str | nn.ModuleList,
                 patterns: Sequence[str], comm: Communicator, *, strict: bool = True, verify_replicas: bool = True,
                 **kwargs: Any) -> WeightSharding:
    """:func:`~wsharding.core.runner.shard_blocks` with the weights read from checkpoint ``path``.

    ``model``: a function that builds the model (called inside
    :func:`~wsharding.empty_build.empty_parameters`), or a model built so
    (``with empty_parameters(): model = build()``) -- then no weight ever exists whole: setup allocates
    each sharded weight's own rows, every other parameter gets empty memory on the rank's device
    (:func:`~wsharding.empty_build.materialize`) and the checkpoint fills both. The built model is
    ``ws.model``. A model built with its weights loads too, but every rank held R before anything
    shrank: :class:`BuiltWholeWarning` names that peak.

    The matching linears are shrunk to this rank's rows (their current values are not kept), the
    checkpoint is loaded -- each sharded weight reads only this rank's rows, every other tensor is
    read whole -- and the sharding is finalized. ``ws.load_result`` holds :func:`load_checkpoint`'s
    counts. Works for any model whose parameter names are the checkpoint's keys (a Hugging Face
    ``save_pretrained`` folder, or :func:`save_checkpoint`'s files).

    ``strict``: as :func:`load_checkpoint` takes it -- ``False`` leaves the checkpoint's tensors that the
    model does not know unread (``ws.load_result["skipped_tensors"]`` counts them); every tensor the
    model has must still be in the checkpoint.

    ``verify_replicas`` is passed on as :func:`~wsharding.core.runner.shard_blocks` takes it, but finds
    nothing to compare here: every row comes from the checkpoint (``keep_initial_weights=False``), and
    the check compares weights kept as built. ``keep_initial_weights=True`` is refused (see
    :func:`_refuse_kept_weights`); every other keyword goes to ``shard_blocks``.

    On CPU ranks (glibc) the process's allocations of 64 KiB or more become mappings of their own,
    for good, so that the load meets its bound in the resident set too ([Note: the CPU load path's
    allocator]).
    """
    # Checked first (a generator of patterns is read once, here): an argument mistake is named before
    # the checkpoint is opened.
    _refuse_kept_weights(kwargs)
    if isinstance(comm, Communicator) and comm.device.type == "cpu":  # a wrong comm is named below
        # [Note: the CPU load path's allocator] Before anything is built or read: every large
        # allocation its own mapping, returned to the system when freed.
        map_large_allocations()
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise InvalidArgument(f"model: a torch.nn.Module or a function that builds one, got {type(model).__name__}")
        build = model
        try:
            with empty_parameters():
                model = build()
        except (NotImplementedError, RuntimeError) as e:
            if "meta" not in str(e):
                raise
            # torch's words name none of this call ("Cannot copy out of meta tensor", ".item() on meta"):
            # the constructor moved or read a weight, which has no values on meta.
            error = InvalidArgument(
                f"model: {getattr(build, '__qualname__', type(build).__name__)} cannot build the model without its "
                f"weights -- load_sharded calls it inside empty_parameters() (every parameter on meta, no values) and "
                f"its constructor moves or reads a weight ({type(e).__name__}: {str(e).split(';')[0].splitlines()[0][:120]}). "
                "Pass the model built with its weights instead (every rank holds them whole first: BuiltWholeWarning), "
                "or build it with a constructor that only creates its parameters")
            abandon_sharding(comm, f"rank {comm.rank} stopped before finalize: {error}")
            raise error from e
        if not isinstance(model, nn.Module):
            raise InvalidArgument(f"model: the function passed as the model returned {type(model).__name__}, "
                                  "not a torch.nn.Module")
    blocks, patterns, layers = check_shard_blocks_args(model, blocks, patterns, comm, kwargs.pop("sharded_layers", None))
    try:
        # Opened (every header and the index checked) before anything is shrunk: a missing or damaged
        # checkpoint leaves the model as it was.
        Checkpoint(path).close()
    except (SafetensorsError, OSError) as e:
        error = CheckpointError(f"checkpoint {path}: {e}")
        abandon_sharding(comm, f"rank {comm.rank} stopped before finalize: {error}")
        raise error from e
    built = model

    def load(ws: WeightSharding) -> dict[str, int]:
        _warn_built_whole(ws)
        if comm.device.type == "cpu":  # [Note: the CPU load path's allocator]
            ws.after_rows_freed = trim_host_heap
        materialize(built, comm.device)  # after setup: only the parameters that are not targets are left on meta
        return load_checkpoint(built, path, strict=strict)

    ws = shard_blocks(model, blocks, patterns, comm, sharded_layers=layers, keep_initial_weights=False,
                      verify_replicas=verify_replicas, load=load, **kwargs)
    ws.model = model
    # [Note: the CPU load path's allocator]
    # On CPU ranks the weights live in the host heap, and glibc's default allocator keeps what the load
    # frees -- the checkpoint's read buffers, the row shards that chunks replaced -- resident in its heap:
    # freeing a mapped block raises its mmap threshold (up to 32 MiB), so the next weights of that size
    # come from the heap, and a heap gives memory back only from its top. A rank's resident set then
    # followed the load's high-water mark, not the bytes it holds: cpu-blocks on 2 ranks peaked at
    # 766-834 MiB during finalize for a bound of 640 MiB (`bench load`). So load_sharded first sets the
    # process's mmap threshold (and trim threshold) to 64 KiB -- a setting of the whole process that
    # stays, and that stops glibc from raising it again. That is not enough where the heap already
    # holds free memory (a model built and freed earlier in the process): glibc serves new allocations
    # from its free lists before it maps anything, so row shards land in the heap again and stay
    # resident when freed. So finalize also trims the heap each time a layer's row shards are freed
    # (``ws.after_rows_freed``), and load_sharded trims it once more at the end.
    ws.host_bytes_released = trim_host_heap() if comm.device.type == "cpu" else 0
    return ws


class BuiltWholeWarning(UserWarning):
    """:func:`load_sharded` was given a model built with its sharded weights whole: every rank held
    them all before they shrank, the peak that loading on meta avoids."""


def _warn_built_whole(ws: WeightSharding) -> None:
    """Rank 0 only (every rank built the same model): the peak the whole weights caused, and the way out."""
    whole = ws.built_whole_bytes
    if not whole or ws.comm.rank != 0:
        return
    mib = 2**20
    bound = ws.formula_bytes() + ws.largest_weight_bytes()
    warnings.warn(
        f"load_sharded: the model was built with its {sum(len(ts) for ts in ws.targets.values())} sharded weights "
        f"whole, {whole / mib:.1f} MiB on every rank before setup shrank them to {whole / ws.comm.world_size / mib:.1f} "
        f"MiB of rows: loading on meta peaks at about {bound / mib:.1f} MiB of them (resident + one weight). Build "
        "the model with its parameters on meta -- `with wsharding.empty_parameters(): model = build()` -- or pass "
        "load_sharded the function that builds it", BuiltWholeWarning, stacklevel=5)


def _refuse_kept_weights(kwargs: dict[str, Any]) -> None:
    """Take ``keep_initial_weights`` out of ``kwargs``: False (what load_sharded sets) is accepted,
    anything else is refused with :class:`~wsharding.core.errors.InvalidArgument`.

    Why not honour True: every row of every sharded weight is read from the checkpoint, so weights
    kept as built would be overwritten row for row -- and, counted as loaded at setup, they would hide
    a row the checkpoint failed to fill, which finalize refuses only with ``keep_initial_weights=False``.
    """
    keep = kwargs.pop("keep_initial_weights", False)
    if keep is not False:
        raise InvalidArgument(
            f"keep_initial_weights={keep!r}: load_sharded reads every row of every sharded weight from the "
            "checkpoint and sets keep_initial_weights=False, so that finalize refuses a row the checkpoint did not "
            "fill (kept weights would count as loaded and hide it). Leave keep_initial_weights out; to shard the "
            "weights the model holds, call shard_blocks(model, blocks, patterns, comm) instead")
