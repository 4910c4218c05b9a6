"""The declare stage: which of a layer's candidate weights are sharded, and why.

Every decision that needs a weight's full shape is taken here, before anything shrinks. The
package's own linears are decided by their group (the parallel contract of SGLang's Linear layers):
tp size 1 (byte-identical on every rank) -> a target, tp size > 1 -> left alone, as the weight-sharding
design shards attention only when attn_tp_size == 1 and MoE peripherals only when replicated. Any
other module with ``tp_size`` > 1 is an error naming it; a weight whose rows the group size does not
divide is left replicated with a warning; one that is not contiguous (a transpose, a strided view)
is refused, as sharded it would round differently from the replica. A layer's targets form one
:class:`~wsharding.core.layout.FlatLayout`: one gather per layer.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from wsharding.core.contract import ParallelLinear
from wsharding.core.errors import ShardingError
from wsharding.core.rowloaders import RowBlock, ShardTarget

SHARD_MODES = ("rows", "requant_then_shard")


class ShardingSkipWarning(UserWarning):
    """A declared target left replicated (its rows are not divisible by the group size)."""


class UnmatchedPatternWarning(UserWarning):
    """A target pattern of :func:`~wsharding.core.runner.shard_blocks` that matches no linear in any
    block (a typo, or a module that is not a linear): it shards nothing, and the model keeps those
    weights whole on every rank."""


def close_names(name: str, known: Sequence[str]) -> str:
    """``" (did you mean 'mlp.fc2'?)"`` -- the names of ``known`` nearest to ``name`` (difflib), for a
    message about a name that is not there; ``""`` when none is near."""
    near = difflib.get_close_matches(name, sorted(set(known)), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(map(repr, near))}?)" if near else ""


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
    return f"group {name!r}, tp size {tp_size(module)}"


def target_name(layer_id: int, layer: nn.Module, target: str | nn.Module) -> str:
    """A declared target as an attribute path: a module given itself is looked up in ``layer``."""
    if isinstance(target, str):
        return target
    for name, mod in layer.named_modules():
        if mod is target and name:
            return name
    raise ShardingError(f"layer {layer_id}: a declared {type(target).__name__} is not a submodule of the layer: "
                        "pass the layer's own linears (or their attribute paths)")


def tp_size(module: nn.Module) -> int:
    if isinstance(module, nn.Linear):
        return 1
    return int(getattr(module, "tp_size", 1))


def row_blocks(module: nn.Module, rows: int) -> list[RowBlock]:
    fn = getattr(module, "row_sub_blocks", None)
    return list(fn()) if fn is not None else [(None, 0, rows, 0)]


def validate_target(layer_id: int, layer: nn.Module, name: str, world_size: int,
                    decisions: list[ShardDecision]) -> ShardTarget | int | None:
    """The target; or the row count of a weight left replicated because N does not divide its
    rows (declare warns once for the layer); or None for a weight the Linear contract leaves alone."""
    try:
        module = layer.get_submodule(name)
    except AttributeError:
        known = [n for n, m in layer.named_modules() if n and isinstance(getattr(m, "weight", None), torch.Tensor)]
        raise ShardingError(f"layer {layer_id}: declared target {name!r} does not exist{close_names(name, known)}; "
                            "name a submodule with a weight by its attribute path in the layer") from None
    tp = tp_size(module)
    if isinstance(module, ParallelLinear):
        group = group_words(module)
        if tp != 1:
            decisions.append(ShardDecision(layer_id, name, False, f"{group}: tensor parallelism already splits "
                                           "it, its bytes differ between ranks"))
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
    if not isinstance(module._parameters.get("weight"), nn.Parameter):
        # A re-parametrized weight (weight_norm, register_parametrization, spectral_norm) is computed
        # from other parameters at each forward: binding it to a slot would bind a value that the next
        # forward recomputes from the replicated originals (and with grad on, it is not a leaf).
        how = ("a parametrization (register_parametrization, parametrizations.weight_norm)"
               if torch.nn.utils.parametrize.is_parametrized(module, "weight")
               else "an attribute computed by a hook (torch.nn.utils.weight_norm, spectral_norm), not a Parameter")
        raise ShardingError(
            f"layer {layer_id} {name}.weight is {how}: weight sharding binds a linear's own weight Parameter to a "
            "slot, and this weight is recomputed from other parameters at every forward. Fold it into a plain "
            "weight before sharding (torch.nn.utils.remove_weight_norm(m), or torch.nn.utils.parametrize."
            "remove_parametrizations(m, 'weight', leave_parametrized=True)), or leave it out of the targets")
    rows = weight.shape[0]
    if rows % world_size:
        decisions.append(ShardDecision(layer_id, name, False,
                                       f"{rows} rows, not divisible by the group size {world_size}"))
        return rows
    if not weight.is_contiguous():
        # Sharded, a weight becomes a contiguous view of its slot (a layout holds row-major bytes).
        # A transposed or strided weight would then reach the matmul in another memory order, which
        # picks another kernel and another reduction order: outputs a few ulps away from the
        # replica's, not bit for bit. Only a pure transpose could get its strides back over a dense
        # range, and every reader of the layout's bytes would have to know it; a contiguous copy
        # made before sharding costs nothing at run time.
        dense = torch.empty(weight.shape, device="meta").stride()
        raise ShardingError(
            f"layer {layer_id} {name}.weight is not contiguous (shape {list(weight.shape)}, strides "
            f"{tuple(weight.stride())}; contiguous: {dense}): sharded, it would be a contiguous view of its slot "
            "and its matmul would round differently from the replicated model's. Make the weights contiguous "
            "before sharding, in the model you shard and in any you compare it with: "
            "for p in model.parameters(): p.data = p.data.contiguous()")
    decisions.append(ShardDecision(layer_id, name, True, why))
    return ShardTarget(layer_id, name, module, tuple(weight.shape), weight.dtype, row_blocks(module, rows), mode)
