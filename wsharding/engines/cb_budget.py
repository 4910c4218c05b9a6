"""How big transformers' paged KV cache is under a memory budget: the budget, less the weights the
rank holds, less a reserve for the engine's other tensors, in the engine's own blocks.

Left alone, transformers' engine sizes its cache from the device's free memory
(``ContinuousBatchingConfig.max_memory_percent`` of what ``torch.cuda.mem_get_info`` reports). That
is not a budget: ranks that time-slice one GPU each see what the others have not taken yet, so the
first to start gets more. The pool is therefore set here, through ``ContinuousBatchingConfig.num_blocks``
(blocks of ``page_size`` tokens of K and V for every layer), from the same three numbers the package's
own scheduler sizes its pool by (:func:`wsharding.serve.budget.pool_blocks`): the budget, the bytes
the model holds (a sharded model: its chunks and slots, so it leaves more), and a reserve.

:func:`check_engine_pool` reads the engine's cache back once it is built: a transformers whose block
holds other bytes, or that resolved another number of blocks, fails there, by name, instead of
serving a pool the report does not describe.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from wsharding.core.errors import InvalidArgument, Unsupported

#: The engine aligns its cache sectors to this many bytes (a sector is the least common multiple of a
#: block's bytes and it): a ``num_blocks`` that is not whole sectors is rounded *up* by the engine.
SECTOR_ALIGN = 128


def kv_block_bytes(config: Any, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one engine block: ``page_size`` tokens of K and V in every layer (full attention, no
    tensor parallelism: every KV head on the rank)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * page_size * kv_heads * head_dim * dtype.itemsize * text.num_hidden_layers


def blocks_per_sector(block_bytes: int) -> int:
    """Blocks in one of the engine's cache sectors (``lcm(block, 128 B) / block``): the engine allocates
    whole sectors, so a pool of whole sectors is the pool it gets, no more."""
    return math.lcm(block_bytes, SECTOR_ALIGN) // block_bytes


def engine_reserve_bytes(config: Any, dtype: torch.dtype, max_batch_tokens: int, max_requests: int,
                         max_context: int) -> int:
    """Bytes set aside for the engine's transient tensors of its largest step -- a stated rule, an upper
    estimate, the same for both variants: ``max_batch_tokens`` rows (M) through the widest projection
    and the attention's new Q/K/V; the K and V of ``max_requests`` contexts of ``max_context`` tokens
    read back from the cache (N), repeated to the query heads (eager / SDPA attention does); the
    attention mask ``M x (N + M)``; float32 logits of every row; the index tensors (int64 per row and
    per read token)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    item = dtype.itemsize
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    m, n = max_batch_tokens, max_requests * max_context
    widest = max(2 * text.intermediate_size, (heads + 2 * kv_heads) * head_dim)
    rows = m * (4 * text.hidden_size + 2 * widest) * item
    read = n * (2 * heads + kv_heads) * head_dim * item
    mask = m * (n + m) * item
    logits = m * text.vocab_size * (item + 4)
    index = (m + n) * 8 * 2
    return rows + read + mask + logits + index


def engine_pool_blocks(budget_bytes: int, resident_bytes: int, reserve_bytes: int, block_bytes: int) -> int:
    """Engine blocks that fit in ``budget - resident - reserve`` bytes, rounded down to whole sectors
    (:func:`blocks_per_sector`), less the engine's two trash sectors (it allocates them beside the pool).
    Refused when no block is left."""
    per_sector = blocks_per_sector(block_bytes)
    left = budget_bytes - resident_bytes - reserve_bytes
    sectors = left // (block_bytes * per_sector) - 2
    if sectors < 1:
        raise InvalidArgument(
            f"a budget of {budget_bytes / 2**20:.1f} MiB leaves no KV pool for the engine: the model holds "
            f"{resident_bytes / 2**20:.1f} MiB and the reserve is {reserve_bytes / 2**20:.1f} MiB. Give the ranks a "
            "larger budget (or shard more weights)")
    return int(sectors * per_sector)


def check_engine_pool(manager: Any, num_blocks: int, block_bytes: int) -> None:
    """The engine's cache, once built, is the pool the budget sized: its blocks hold ``block_bytes`` and
    there are ``num_blocks`` of them. Raises :class:`~wsharding.core.errors.Unsupported` naming what
    differs (another transformers' cache layout: the report would describe a pool that was not served)."""
    bp = getattr(manager, "batch_processor", None)
    cache = getattr(bp, "cache", None)
    if cache is None:
        raise Unsupported("the engine built no cache to check (its batch processor has none): this transformers' "
                          "ContinuousBatchingManager is not the one the budget was sized for")
    got = sum(ca.bytes_per_block for ca in cache.cache_allocators.values())
    if got != block_bytes or cache.num_blocks != num_blocks:
        raise Unsupported(f"the engine's cache is {cache.num_blocks} blocks of {got} B, the budget sized "
                          f"{num_blocks} blocks of {block_bytes} B: this transformers lays its cache out otherwise; "
                          "the pool served would not be the pool reported")
