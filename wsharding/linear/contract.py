"""The five alignment checks of the parallel contract of SGLang's Linear layers, over a model's linears.

Most Linear bugs are not in one contract but where two meet: each side is self-consistent, and the
pair is misaligned. For each linear the diagnostic compares the two sides the contract names:

=============  ==================================================  ==============================================
rule           left                                                right
=============  ==================================================  ==============================================
``group``      (rank, size) the parameters were shaped with         (rank, size) the loader reads from tp_group now
``size``       global sizes (output_sizes, input_size)              per-rank sizes x group size; parameter extents
``packing``    logical row offsets / sizes of each sub-block        pack factor / scale block boundaries
``kv-replica`` num_kv_heads, num_kv_head_replicas                   what the KV group size and total KV heads imply
``reduction``  the group the weight is split on                     the group the partial sums are added on
=============  ==================================================  ==============================================

Every :class:`Finding` names the linear (its module path) and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from wsharding.core.errors import InvalidArgument
from wsharding.core.units import ceil_div
from wsharding.linear.base import LinearBase
from wsharding.linear.column import ColumnParallelLinear, MergedColumnParallelLinear
from wsharding.linear.groups import GroupError, group_rank_size, same_collective
from wsharding.linear.parameters import BlockQuantScaleParameter, PackedParameter
from wsharding.linear.qkv import QKVParallelLinear, kv_head_split
from wsharding.linear.row import RowParallelLinear

RULES = ("group", "size", "packing", "kv-replica", "reduction")


@dataclass(frozen=True)
class Finding:
    """One misalignment: ``linear`` (module path), ``rule`` (one of :data:`RULES`), what is wrong."""

    linear: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.linear}: {self.message}"


def linears(model: nn.Module) -> list[tuple[str, LinearBase]]:
    """Every linear of ``model`` with its module path (``"."`` for the model itself)."""
    return [(name or ".", m) for name, m in model.named_modules() if isinstance(m, LinearBase)]


def _sub_blocks(layer: LinearBase) -> list[tuple[object, int, int, int]]:
    if isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear)):
        return layer.row_sub_blocks()
    if isinstance(layer, ColumnParallelLinear):
        return [(0, 0, layer.output_size_per_partition, layer.tp_rank * layer.output_size_per_partition)]
    return [(0, 0, layer.output_size, 0)]


def check_group(layer: LinearBase) -> list[str]:
    shaped, loader = layer.partition_rank_size, group_rank_size(layer.tp_group)
    if shaped != loader:
        return [f"parameters were shaped for rank {shaped[0]} of {shaped[1]} but the loader would use rank "
                f"{loader[0]} of {loader[1]} (tp_group was rebound after construction)"]
    return []


def check_size(layer: LinearBase) -> list[str]:
    out: list[str] = []
    tp = layer.partition_rank_size[1]
    if isinstance(layer, QKVParallelLinear):
        q, k, v = layer.output_partition_sizes
        if q * tp != layer.output_sizes[0]:
            out.append(f"q: {q} rows per rank x {tp} ranks != {layer.output_sizes[0]} global rows")
        for name, part, total in (("k", k, layer.output_sizes[1]), ("v", v, layer.output_sizes[2])):
            if part * layer.kv_tp_size != total * layer.num_kv_head_replicas:
                out.append(f"{name}: {part} rows per rank x {layer.kv_tp_size} KV ranks != {total} global rows x "
                           f"{layer.num_kv_head_replicas} replicas")
    elif isinstance(layer, MergedColumnParallelLinear):
        if sum(layer.output_sizes) != layer.output_size:
            out.append(f"sum(output_sizes)={sum(layer.output_sizes)} != output_size={layer.output_size}")
        for i, (part, total) in enumerate(zip(layer.output_partition_sizes, layer.output_sizes, strict=True)):
            if part * tp != total:
                out.append(f"sub-tensor {i}: {part} rows per rank x {tp} ranks != output_sizes[{i}]={total}")
    elif isinstance(layer, ColumnParallelLinear):
        if layer.output_size_per_partition != ceil_div(layer.output_size, tp):
            out.append(f"{layer.output_size_per_partition} rows per rank != ceil({layer.output_size} / {tp})")
    elif isinstance(layer, RowParallelLinear):
        if layer.input_size_per_partition != ceil_div(layer.input_size, tp):
            out.append(f"{layer.input_size_per_partition} input columns per rank != ceil({layer.input_size} / {tp})")
    if sum(layer.output_partition_sizes) != layer.output_size_per_partition:
        out.append(f"output_partition_sizes {layer.output_partition_sizes} do not add up to "
                   f"output_size_per_partition={layer.output_size_per_partition}")
    for pname, p in layer.named_parameters(recurse=False):
        for dim, logical in ((getattr(p, "output_dim", None), layer.output_size_per_partition),
                             (getattr(p, "input_dim", None), layer.input_size_per_partition)):
            if dim is None or not hasattr(p, "physical"):
                continue
            try:
                want = p.physical(dim, logical)
            except ValueError as e:
                out.append(str(e))
                continue
            if p.shape[dim] != want:
                out.append(f"{pname} has {p.shape[dim]} elements on dim {dim}, expected {want} for {logical} "
                           "logical per-rank rows/columns")
    return out


def check_packing(layer: LinearBase) -> list[str]:
    out: list[str] = []
    for pname, p in layer.named_parameters(recurse=False):
        if isinstance(p, PackedParameter) and p.packed_dim == p.output_dim:
            unit, what = p.pack_factor, f"pack_factor {p.pack_factor}"
        elif isinstance(p, BlockQuantScaleParameter):
            unit, what = p.block[0], f"scale block_n {p.block[0]}"
        else:
            continue
        blocks = _sub_blocks(layer)
        for shard, p_off, rows, ck_off in blocks:
            if len(blocks) == 1 and layer.tp_size == 1 and isinstance(p, BlockQuantScaleParameter):
                continue  # one whole, unsplit block: an edge scale block is fine
            bad = [f"{k}={v}" for k, v in (("param_offset", p_off), ("rows", rows), ("checkpoint_offset", ck_off))
                   if v % unit]
            if bad:
                out.append(f"{pname}, sub-block {shard!r}: {', '.join(bad)} not multiples of {what}: logical rows "
                           "land on the wrong stored rows")
    return out


def check_kv_replica(layer: LinearBase) -> list[str]:
    if not isinstance(layer, QKVParallelLinear):
        return []
    try:
        want = kv_head_split(layer.total_num_kv_heads, layer.kv_tp_size)
    except GroupError as e:
        return [str(e)]
    have = (layer.num_kv_heads, layer.num_kv_head_replicas)
    out = []
    if have != want:
        out.append(f"(num_kv_heads, num_kv_head_replicas) = {have}, but {layer.total_num_kv_heads} KV heads on a KV "
                   f"group of {layer.kv_tp_size} give {want}")
    for shard, _, rows, ck_off in layer.row_sub_blocks()[1:]:
        if ck_off + rows > layer.output_sizes[1]:
            out.append(f"{shard}: KV rank {layer.kv_tp_rank} would read checkpoint rows [{ck_off}, {ck_off + rows}) "
                       f"beyond the {layer.output_sizes[1]} rows of the {shard} tensor")
    return out


def check_reduction(layer: LinearBase) -> list[str]:
    if not isinstance(layer, RowParallelLinear) or layer.tp_size == 1 and layer.reduce_group_override is None:
        return []
    try:
        red = layer.reduce_group
    except GroupError as e:
        return [str(e)]
    if same_collective(red, layer.tp_group):
        return []
    rs, ts = group_rank_size(red)[1], layer.tp_size
    return [f"weight split over a group of {ts} ({layer.parallel_group!r}) but partial sums are reduced over a group of "
            f"{rs} (use_dp_attention_reduce={layer.use_dp_attention_reduce}): sums cross DP replicas or miss ranks"]


CHECKS = {"group": check_group, "size": check_size, "packing": check_packing, "kv-replica": check_kv_replica,
          "reduction": check_reduction}


def check_contract(model: nn.Module, rules: tuple[str, ...] = RULES) -> list[Finding]:
    """Run the five alignment checks on every linear of ``model``; an empty list means aligned."""
    unknown = set(rules) - set(RULES)
    if unknown:
        raise InvalidArgument(f"unknown contract rules {sorted(unknown)}: choose from {RULES}")
    findings = []
    for name, layer in linears(model):
        for rule in rules:
            findings += [Finding(name, rule, msg) for msg in CHECKS[rule](layer)]
    return findings


def contract_table(model: nn.Module) -> list[dict[str, object]]:
    """One row per linear: kind, group, this rank's place, per-rank weight shape, who reduces."""
    rows = []
    for name, layer in linears(model):
        reduce = "-"
        if isinstance(layer, RowParallelLinear):
            if layer.tp_size == 1:
                reduce = "none (not split)"
            elif not layer.reduce_results:
                reduce = "layer boundary"
            else:
                reduce = f"all-reduce over {group_rank_size(layer.reduce_group)[1]} ranks"
        elif isinstance(layer, ColumnParallelLinear) and layer.gather_output and layer.tp_size > 1:
            reduce = f"all-gather over {layer.tp_size} ranks"
        rows.append({
            "linear": name, "kind": type(layer).__name__, "group": str(layer.parallel_group),
            "tp_rank": layer.tp_rank, "tp_size": layer.tp_size,
            "per_rank_weight": [layer.output_size_per_partition, layer.input_size_per_partition],
            "global_weight": [layer.output_size, layer.input_size], "reduction": reduce,
        })
    return rows
