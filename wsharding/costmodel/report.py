"""The text report of a plan: what ``wsharding plan`` prints and the notebooks show.

Presentation only: every number comes from :class:`~wsharding.costmodel.plan.Plan` and its
:class:`~wsharding.costmodel.bill.Bill`; nothing here computes one the bill does not.
"""

from __future__ import annotations

import textwrap

from wsharding.core.layout import SUPPORTED_DTYPES
from wsharding.core.units import GB, GiB, fmt_bytes
from wsharding.costmodel.plan import Plan


def fmt_seconds(s: float) -> str:
    """``s`` seconds as microseconds below a millisecond, else milliseconds (``0`` stays ``0``)."""
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.3f} ms"


def plan_table(plan: Plan) -> str:
    """A readable multi-line report of a :class:`Plan` (GiB = 2**30 B, GB = 10**9 B)."""
    b, d, m = plan.bill, plan.deployment, plan.model
    L = plan.largest
    lines = [textwrap.fill(f"wsharding plan: {m.name}" + (f" -- {m.description}" if m.description else ""), 100,
                           subsequent_indent="    ")]
    if m.source:
        lines.append(f"  source: {m.source}")
    for a in m.assumptions:  # wrapped: a notebook's output area breaks long lines inside words
        lines.append(textwrap.fill(a, 100, initial_indent="  assumption: ", subsequent_indent="    "))
    lines += [
        f"  shard group N = {b.ranks}, {b.layers} sharded layers, device {d.device.name}, "
        f"link {d.bandwidth / GB:.0f} GB/s per direction, {d.tokens} tokens per step, efficiency {d.efficiency:g}",
        "",
        "replicated weights per GPU, by group:",
    ]
    for name, dt, nb in plan.groups:
        lines.append(f"  {name:<28} {SUPPORTED_DTYPES[dt]:<9} {fmt_bytes(nb)}")
    lines += [
        f"  {'total R':<28} {'':<9} {fmt_bytes(b.replicated_bytes)}",
        "",
        "memory per GPU                 replicated             sharded",
        f"  weights (R | shards sum|T|/N) {b.replicated_bytes / GiB:>10.2f} GiB {b.resident_shard_bytes / GiB:>14.2f} GiB",
        f"  {'mapped slots 2(N-1)/N max|T|' if b.map_own_chunk else 'two slots (2 max|T|)':<30}"
        f"{0:>10.2f} GiB {b.slot_bytes / GiB:>14.2f} GiB",
        f"  total                         {b.replicated_bytes / GiB:>10.2f} GiB {b.sharded_resident_bytes / GiB:>14.2f} GiB",
        "",
        f"  gross saving R (the design's 'reclaimed'): {fmt_bytes(b.gross_saving_bytes)}",
        f"  shard saving R - sum|T|/N (~(1-1/N)R):   {fmt_bytes(b.shard_saving_bytes)}",
        f"  net saving, after the two slots:         {fmt_bytes(b.net_saving_bytes)}  ({b.net_saving_bytes} B)",
        f"  (layout padding over all layers: {b.padding_bytes} B)",
    ]
    if b.net_saving_bytes <= 0:
        lines.append("  -> sharding does not pay: the two slots cost more than the shards give back")
    lp = plan.load_peaks()
    lines += [
        "",
        "load peaks per GPU (upper bounds; largest single weight " + fmt_bytes(plan.largest_weight_bytes) + "):",
        f"  device, row-shard loading (BF16, ModelOpt FP8): {fmt_bytes(lp['device_rows'])}",
        f"  device, block FP8 requant-then-shard:           {fmt_bytes(lp['device_requant_then_shard'])}"
        "  (not reduced: full weights first)",
        f"  host: one shard + one weight:                   {fmt_bytes(lp['host'])}",
    ]
    lines += [
        "",
        f"traffic and time (largest layer {L.index}, |T| = {fmt_bytes(L.layout_bytes)}):",
        f"  AllGather per rank per layer (N-1)/N |T|: {fmt_bytes(L.gather_bytes_per_rank)}, "
        f"{fmt_seconds(L.gather_seconds)} at {d.bandwidth / GB:.0f} GB/s",
        f"  compute of the sharded GEMMs of that layer at {d.tokens} tokens: {fmt_seconds(L.compute_seconds)}",
    ]
    w = plan.worst_pair
    if w is None:
        lines.append("  one sharded layer only: its gather is issued up front and cannot hide behind another")
    else:
        lines += [
            f"  hardest gather to hide: layer {w.index} ({w.kind}) behind layer {w.index - 1}: "
            f"ratio gather/compute {w.hide_ratio:.2f} at {d.tokens} tokens",
            f"  break-even: every gather hides from {plan.breakeven_tokens} tokens per step "
            "(compute counts only the sharded GEMMs: a conservative bound)",
            f"  exposed gather time per step at {d.tokens} tokens: {fmt_seconds(plan.exposed_seconds_per_step)}",
        ]
    if plan.kv_bytes_per_token:
        lines.append(f"\nKV cache: {plan.kv_bytes_per_token} B per token -> net saving buys {plan.extra_kv_tokens} tokens"
                     + (f" = {plan.extra_requests} requests of {d.context} tokens" if d.context else ""))
    cap = plan.kv_capacity()
    if cap is not None:
        seq = (f"; sequences of {cap['context']} tokens: {cap['sequences_replicated']:,} -> {cap['sequences_sharded']:,}"
               if cap["context"] else "")
        lines.append(f"KV pool per GPU {cap['pool_bytes_replicated'] / GiB:.2f} GiB replicated -> "
                     f"{cap['pool_bytes_sharded'] / GiB:.2f} GiB sharded: tokens {cap['tokens_replicated']:,} -> "
                     f"{cap['tokens_sharded']:,}{seq}")
    return "\n".join(lines)
