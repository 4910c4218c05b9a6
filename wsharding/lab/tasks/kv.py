"""Rank tasks of the KV-cache pool: what the memory weight sharding gives back buys (notebook 06 section 6).

* :func:`kv_decode_equality` -- the decode path (prefill, then one token at a time through a
  :class:`~wsharding.models.kv_cache.KVCachePool`), sharded against replicated, bit for bit;
* :func:`kv_capacity_now` -- KV tokens and sequences that fit replicated vs sharded, from the memory
  measured after finalize.
"""

from __future__ import annotations

from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.context import RankContext
from wsharding.models import build_pair, decoder_config
from wsharding.models.kv_cache import (
    KVCachePool,
    KVStep,
    kv_bytes_per_token,
    ranks_sharing_device,
    replicated_vs_sharded,
)


def _prompts(rank: int, count: int, length: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 31 * seed + count)
    return torch.randint(0, vocab, (count, length), generator=g).to(device)


def kv_decode_equality(ctx: RankContext, preset: str, *, sequences: int = 3, prompt: int = 5, decode: int = 4,
                       comm: str = "torch") -> dict[str, Any]:
    """Prefill ``sequences`` prompts of ``prompt`` tokens, then ``decode`` single-token steps, in the sharded
    and the replicated model, each with its own pool; logits compared bit for bit at every step."""
    cfg = decoder_config(preset)
    comm_ = shard_comm_for(ctx, comm)
    replicated, sharded = build_pair(cfg, comm_)
    length = prompt + decode
    pools = [KVCachePool.allocate(m, sequences, length) for m in (replicated, sharded)]
    firsts = [p.add(sequences) for p in pools]
    tokens = _prompts(ctx.rank, sequences, length, cfg.vocab, comm_.device)
    equal, gathers = [], []
    with torch.no_grad():
        pos = 0
        for new in [prompt] + [1] * decode:
            x = tokens[:, pos : pos + new]
            outs = [m.forward_cached(x, KVStep(p, f, sequences, pos, new))
                    for m, p, f in zip((replicated, sharded), pools, firsts, strict=True)]
            gathers.append(sharded.planner.gathers_this_step)
            equal.append(bool(torch.equal(outs[0], outs[1])))
            pos += new
        full = sharded(tokens[0])  # the uncached forward of sequence 0, for a sanity check of the cache
    return {"rank": ctx.rank, "mode": comm_.mode, "equal": equal, "gathers": gathers,
            "lengths": pools[1].lengths[:sequences], "kv_bytes_per_token": kv_bytes_per_token(sharded),
            "pool_bytes": pools[1].nbytes, "cached_vs_full_max_diff": float((outs[1][0, -1].float() - full[-1].float()).abs().max())}


def kv_capacity_now(ctx: RankContext, preset: str, *, context: int = 256, reserve_bytes: int = 0,
                    comm: str = "torch", cap_bytes: int | None = None) -> dict[str, Any]:
    """Both models on this rank, after finalize: the KV tokens and sequences of ``context`` tokens that
    would fit with only the replicated or only the sharded one (see
    :func:`~wsharding.models.kv_cache.replicated_vs_sharded`), and the sharding's own byte counts.
    ``cap_bytes``: the memory of each rank (CPU ranks: an emulated one; default the machine's RAM)."""
    cfg = decoder_config(preset)
    comm_ = shard_comm_for(ctx, comm)
    replicated, sharded = build_pair(cfg, comm_)
    ws = sharded.weight_sharding
    out = replicated_vs_sharded(replicated, sharded, ws, context=context, reserve_bytes=reserve_bytes,
                                cap_bytes=cap_bytes, share=ranks_sharing_device(ctx.world_size, comm_.device))
    out.update({"rank": ctx.rank, "mode": comm_.mode, "emulation": ctx.emulation,
                "replicated_bytes": ws.replicated_bytes(), "resident_bytes": ws.resident_bytes()})
    return out


# ---- on GPUs: fill the pool and run the batch --------------------------------------------------------
