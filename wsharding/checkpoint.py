"""Checkpoints in safetensors: save a replicated model, load into a (sharded) model row range by row range.

A checkpoint stores weights as the original model does: separate ``q_proj`` / ``k_proj`` / ``v_proj``
and ``gate_proj`` / ``up_proj`` tensors, which the merged linears load by shard id. Loading calls
each parameter's ``weight_loader``: the linear's own (v1/v2) for replicated weights, and the
row-shard loader that weight sharding installs on its targets. The row-shard loader is handed a
lazy safetensors slice, so a rank reads only its own rows of a sharded weight from the file.

Every problem is reported with the tensor's name: a missing tensor, an unexpected one, a wrong shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from wsharding.shard import RowShardLoader

#: merged parameter -> the checkpoint tensors it is loaded from, with their shard ids
STACKED: dict[str, list[tuple[str, Any]]] = {
    "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: names the tensor and what is wrong."""


def checkpoint_layout(model: nn.Module) -> Iterator[tuple[str, str, Any]]:
    """``(checkpoint key, parameter name, shard id)`` for every tensor the model loads."""
    names = {n for n, _ in model.named_parameters()}
    # weights rebound to slot views are no longer parameters: a finalized model cannot be loaded
    for name in sorted(names):
        module_path, _, leaf = name.rpartition(".")
        parent, _, mod_name = module_path.rpartition(".")
        if mod_name in STACKED and leaf == "weight":
            for ckpt_mod, shard_id in STACKED[mod_name]:
                yield f"{parent + '.' if parent else ''}{ckpt_mod}.{leaf}", name, shard_id
        else:
            yield name, name, None


def save_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Write a replicated (tp 1) model's weights as a safetensors file, merged weights split back
    into their checkpoint tensors."""
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for key, pname, shard_id in checkpoint_layout(model):
        p = params[pname].detach()
        if shard_id is None:
            out[key] = p.contiguous().cpu()
            continue
        module = model.get_submodule(pname.rpartition(".")[0])
        blocks = {b[0]: b for b in module.row_sub_blocks()}
        _, offset, rows, _ = blocks[shard_id]
        if getattr(module, "tp_size", 1) != 1:
            raise CheckpointError(f"{pname}: only models built with tp 1 can be saved as full checkpoints")
        out[key] = p[offset : offset + rows].contiguous().cpu()
    save_file(out, str(path))


def load_checkpoint(model: nn.Module, path: str | Path, *, strict: bool = True) -> dict[str, int]:
    """Load ``path`` into ``model`` through each parameter's weight loader.

    Returns ``{"tensors": n, "row_shard_tensors": m}``. Raises :class:`CheckpointError` naming the
    tensor when one is missing, unexpected (with ``strict``) or misshapen.
    """
    params = dict(model.named_parameters())
    plan = list(checkpoint_layout(model))
    counts = {"tensors": 0, "row_shard_tensors": 0}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing = [k for k, _, _ in plan if k not in keys]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise CheckpointError(
                f"checkpoint {path} is missing tensor(s) {missing[:3]}{more} needed by the model; "
                "was it written for another model or preset?"
            )
        unexpected = sorted(keys - {k for k, _, _ in plan})
        if strict and unexpected:
            raise CheckpointError(f"checkpoint {path} has tensor(s) the model does not know: {unexpected[:3]}")
        for key, pname, shard_id in plan:
            param = params[pname]
            loader = getattr(param, "weight_loader", None)
            try:
                if isinstance(loader, RowShardLoader):
                    # a lazy slice: the loader reads only this rank's rows from the file
                    loader(param, f.get_slice(key), shard_id)
                    counts["row_shard_tensors"] += 1
                else:
                    tensor = f.get_tensor(key).to(param.device)
                    if loader is None:
                        _default_loader(param, tensor)
                    elif shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
            except CheckpointError:
                raise
            except (ValueError, RuntimeError) as e:
                raise CheckpointError(f"checkpoint tensor {key!r} (for parameter {pname}) cannot be loaded: {e}") from e
            counts["tensors"] += 1
    return counts


def _default_loader(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(f"shape {list(tensor.shape)} does not match the parameter's {list(param.shape)}")
    param.data.copy_(tensor)
