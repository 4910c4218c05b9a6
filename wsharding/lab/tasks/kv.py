"""Rank tasks of the KV-cache pool: what the memory weight sharding gives back buys (notebook 06 section 6).

* :func:`kv_decode_equality` -- the decode path (prefill, then one token at a time through a
  :class:`~wsharding.models.kv_cache.KVCachePool`), sharded against replicated, bit for bit;
* :func:`kv_capacity_now` -- KV tokens and sequences that fit replicated vs sharded, from the memory
  measured after finalize;
* :func:`kv_fill` -- CUDA: under a per-process memory cap, size the pool from what is free after
  finalize, fill it with sequences, run the batch; then show that the same batch does not fit replicated.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from wsharding.context import RankContext
from wsharding.errors import Unsupported
from wsharding.lab.tasks.model import shard_comm_for
from wsharding.models import ToyDecoder, build_pair, decoder_config
from wsharding.models.kv_cache import (
    KVCachePool,
    KVStep,
    kv_budget_bytes,
    kv_bytes_per_token,
    ranks_sharing_device,
    replicated_vs_sharded,
)
from wsharding.shard import WeightSharding


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
                    comm: str = "torch") -> dict[str, Any]:
    """Both models on this rank, after finalize: the KV tokens and sequences of ``context`` tokens that
    would fit with only the replicated or only the sharded one (see
    :func:`~wsharding.models.kv_cache.replicated_vs_sharded`), and the sharding's own byte counts."""
    cfg = decoder_config(preset)
    comm_ = shard_comm_for(ctx, comm)
    replicated, sharded = build_pair(cfg, comm_)
    ws = sharded.weight_sharding
    out = replicated_vs_sharded(replicated, sharded, ws, context=context, reserve_bytes=reserve_bytes,
                                share=ranks_sharing_device(ctx.world_size, comm_.device))
    out.update({"rank": ctx.rank, "mode": comm_.mode, "emulation": ctx.emulation,
                "replicated_bytes": ws.replicated_bytes(), "resident_bytes": ws.resident_bytes()})
    return out


# ---- on GPUs: fill the pool and run the batch --------------------------------------------------------
def _cap(device: torch.device, cap_bytes: int) -> None:
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(0.0, cap_bytes / total)), device)


def _outside_torch(comm: Any) -> int:
    """Device bytes our NCCL communicator holds outside torch's allocator (ncclMemAlloc)."""
    return 0 if comm.pool is None else comm.pool.allocated_bytes


def _free_cached() -> None:
    """Hand memory of dropped tensors back (the caller deleted its references first)."""
    gc.collect()
    torch.cuda.empty_cache()


def _min_over_ranks(value: int, device: torch.device) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _fill_and_run(model: ToyDecoder, sequences: int, context: int, chunk: int, piece: int, vocab: int,
                  rank: int) -> dict[str, Any]:
    """Allocate a pool of ``sequences`` x ``context``, prefill every sequence to ``context - 1`` tokens
    (``chunk`` sequences and ``piece`` tokens per forward, so activations stay small), then decode one
    token for the whole batch in one step."""
    dev = model.embed.weight.device
    pool = KVCachePool.allocate(model, sequences, context)
    t0 = time.perf_counter()
    with torch.no_grad():
        for first in range(0, sequences, chunk):
            n = min(chunk, sequences - first)
            got = pool.add(n)
            prompt = _prompts(rank, n, context - 1, vocab, dev, first)
            for pos in range(0, context - 1, piece):
                x = prompt[:, pos : pos + piece]
                model.forward_cached(x, KVStep(pool, got, n, pos, x.shape[1]))
        last = _prompts(rank, sequences, 1, vocab, dev, -1)
        out = model.forward_cached(last, KVStep(pool, 0, sequences, context - 1, 1))
        torch.cuda.synchronize(dev)
    return {"sequences": sequences, "tokens_in_pool": sum(pool.lengths), "pool_bytes": pool.nbytes,
            "decode_logits": list(out.shape), "seconds": time.perf_counter() - t0,
            "peak_allocated": torch.cuda.max_memory_allocated(dev)}


def kv_fill(ctx: RankContext, preset: str, *, context: int = 4096, kv_gib_replicated: float = 2.0,
            reserve_gib: float = 1.0, chunk: int = 4, piece: int = 512, comm: str = "torch") -> dict[str, Any]:
    """CUDA only. Emulate a GPU whose memory leaves ``kv_gib_replicated`` GiB of KV cache to the replicated
    model (a per-process cap: ``torch.cuda.set_per_process_memory_fraction``, labelled in the result):

    1. replicated model alone: the pool it can size from the free memory -> ``sequences_replicated``;
    2. sharded model alone, after finalize: the same measurement -> ``sequences_sharded`` (larger by the
       bytes sharding gave back); allocate that pool, fill every sequence to ``context`` tokens and decode
       the whole batch in one step -- it runs;
    3. replicated model again, the sharded batch: allocating its pool and running it fails with an
       out-of-memory error under the same cap.

    ``reserve_gib``: room kept for the activations in both cases (prefill runs ``chunk`` sequences x ``piece``
    tokens per forward to stay inside it). Every rank does the same steps.
    """
    cfg = decoder_config(preset)
    comm_ = shard_comm_for(ctx, comm)
    dev = comm_.device
    if dev.type != "cuda":
        raise Unsupported("kv_fill needs CUDA ranks: on CPU use kv_capacity_now (no allocator cap to enforce)")
    reserve = int(reserve_gib * 2**30)
    torch.cuda.reset_peak_memory_stats(dev)
    # 1. replicated alone: the cap is set so that this model leaves kv_gib_replicated for KV
    rep = ToyDecoder(cfg, seed=0, device=dev).eval()
    torch.cuda.synchronize(dev)
    cap = torch.cuda.memory_allocated(dev) + _outside_torch(comm_) + reserve + int(kv_gib_replicated * 2**30)
    _cap(dev, cap - _outside_torch(comm_))
    kv = kv_bytes_per_token(rep)
    budget_r, how = kv_budget_bytes(dev, reserve_bytes=reserve, cap_bytes=cap - _outside_torch(comm_))
    seq_r = budget_r // (kv * context)
    del rep
    _free_cached()
    # 2. sharded alone
    ws = WeightSharding(comm_, sharded_layers=range(1, cfg.layers))
    sh = ToyDecoder(cfg, seed=0, weight_sharding=ws, device=dev).eval()
    ws.finalize()
    torch.cuda.synchronize(dev)
    outside = _outside_torch(comm_)
    _cap(dev, cap - outside)
    budget_s, _ = kv_budget_bytes(dev, reserve_bytes=reserve, cap_bytes=cap - outside)
    seq_s = _min_over_ranks(budget_s // (kv * context), dev)
    ran = _fill_and_run(sh, seq_s, context, chunk, piece, cfg.vocab, ctx.rank)
    ws.close()
    del sh, ws
    _free_cached()
    # 3. replicated again, the sharded batch
    _cap(dev, cap - _outside_torch(comm_))
    rep = ToyDecoder(cfg, seed=0, device=dev).eval()
    replicated_error = ""
    try:
        _fill_and_run(rep, seq_s, context, chunk, piece, cfg.vocab, ctx.rank)
    except torch.cuda.OutOfMemoryError as e:
        replicated_error = str(e).splitlines()[0]
    del rep
    _free_cached()
    _cap(dev, torch.cuda.get_device_properties(dev).total_memory)
    return {"rank": ctx.rank, "mode": comm_.mode, "emulation": comm_.emulation or ctx.emulation,
            "cap": f"per-process memory cap of {cap / 2**30:.2f} GiB (set_per_process_memory_fraction): a GPU "
                   f"whose memory leaves {kv_gib_replicated:g} GiB of KV cache to the replicated model",
            "measured": how, "cap_bytes": cap, "reserve_bytes": reserve, "context": context, "kv_bytes_per_token": kv,
            "budget_replicated": budget_r, "budget_sharded": budget_s,
            "sequences_replicated": seq_r, "sequences_sharded": seq_s, "sharded_run": ran,
            "replicated_error": replicated_error}
