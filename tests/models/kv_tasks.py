"""The KV-cache pool filled on GPUs: under a per-process memory cap, size the pool from what is free
after finalize, fill it with sequences, run the batch; then show that the same batch does not fit
replicated. A rank task of tests/models/test_gpu_kv.py (module level: spawned ranks import it by name).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.errors import Unsupported
from wsharding.core.sharding import WeightSharding
from wsharding.models import ToyDecoder, decoder_config
from wsharding.models.kv_cache import KVCachePool, KVStep, kv_budget_bytes, kv_bytes_per_token


def _prompts(rank: int, count: int, length: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 31 * seed + count)
    return torch.randint(0, vocab, (count, length), generator=g).to(device)


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


def kv_fill(ctx, preset: str, *, context: int = 4096, kv_gib_replicated: float = 2.0,
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
