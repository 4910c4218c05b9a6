"""Rank tasks for the sharded decoder: equality against the replicated twin, and timed steps.

They live in the package because spawned ranks import tasks by name; tests, the demo and the
notebooks all call them.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.cluster import RankContext
from wsharding.models import PRESETS, DecoderConfig, build_pair
from wsharding.shard import aligned_forward


def tokens_for(rank: int, step: int, counts: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """This rank's tokens at ``step``: ``counts[step][rank]`` ids (0 means an idle rank)."""
    n = counts[step % len(counts)][rank % len(counts[0])]
    g = torch.Generator().manual_seed(7919 * rank + step)
    return torch.randint(0, vocab, (n,), generator=g).to(device)


def _config(preset: str | DecoderConfig) -> DecoderConfig:
    return preset if isinstance(preset, DecoderConfig) else PRESETS[preset]


def model_equality(ctx: RankContext, preset: str | DecoderConfig, counts: list[list[int]], *, lookahead: bool = True,
                   group_size: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Build the replicated and sharded models, run ``len(counts)`` steps with ``counts[step][rank]``
    tokens on this rank (idle ranks run a one-token dummy step), compare outputs bit for bit."""
    cfg = _config(preset)
    comm = ctx.shard_comm(group_size or ctx.world_size)
    replicated, sharded = build_pair(cfg, comm, seed=seed, lookahead=lookahead)
    ws = sharded.weight_sharding
    equal, max_diff, gathers, waits = [], 0.0, [], []
    with torch.no_grad():
        for step in range(len(counts)):
            x = tokens_for(ctx.rank, step, counts, cfg.vocab, comm.device)
            out_s = aligned_forward(sharded, x, sharded.dummy_tokens)
            gathers.append(ws.planner.gathers_this_step)
            waits.append(ws.planner.waits_this_step)
            if out_s is None:
                equal.append(None)
                continue
            out_r = replicated(x)
            equal.append(bool(torch.equal(out_r, out_s)))
            max_diff = max(max_diff, float((out_r.float() - out_s.float()).abs().max()))
    return {
        "rank": ctx.rank,
        "equal": equal,
        "max_abs_diff": max_diff,
        "gathers": gathers,
        "waits": waits,
        "sharded_layers": ws.sharded_layer_ids,
        "replicated_bytes": ws.replicated_bytes(),
        "resident_bytes": ws.resident_bytes(),
        "formula_bytes": ws.formula_bytes(),
        "slot_bytes": ws.slots.slot_bytes,
        "layout_bytes": [ws.layouts[i].total_bytes for i in ws.sharded_layer_ids],
        "mode": comm.mode,
    }
