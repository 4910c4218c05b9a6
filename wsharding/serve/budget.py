"""How big the KV pool is: the memory budget, less what the model holds, less a reserve for activations.

This is where weight sharding pays or does not. SGLang's weight sharding for Kimi K3 finalizes the
sharding before the KV pool is sized, so every byte it gives back is seen here and becomes KV tokens.
"""

from __future__ import annotations

from typing import Any

from wsharding.core.errors import InvalidArgument
from wsharding.serve.blocks import BLOCK_TOKENS


def pool_blocks(budget_bytes: int, resident_bytes: int, reserve_bytes: int, bytes_per_token: int) -> int:
    """KV blocks of a :class:`~wsharding.serve.blocks.BlockPool` that fit in ``budget - resident - reserve``
    bytes, its scratch block included (so one less than the quotient)."""
    left = budget_bytes - resident_bytes - reserve_bytes
    blocks = left // (BLOCK_TOKENS * bytes_per_token) - 1
    if blocks < 1:
        raise InvalidArgument(
            f"a budget of {budget_bytes / 2**20:.1f} MiB leaves no KV pool: the model holds "
            f"{resident_bytes / 2**20:.1f} MiB and the activations need {reserve_bytes / 2**20:.1f} MiB. "
            "Give the ranks a larger budget (or shard more weights)")
    return int(blocks)


def budget_for_share(resident_bytes: int, reserve_bytes: int, share: float) -> int:
    """The budget in which the KV pool is ``share`` of the whole (0 < share < 1): what the weights and
    the reserve take is the rest, so ``budget = (resident + reserve) / (1 - share)``."""
    if not 0 < share < 1:
        raise InvalidArgument(f"KV share: need a fraction of the budget strictly between 0 and 1, got {share}")
    return int(-(-(resident_bytes + reserve_bytes) // (1 - share)))


def budget_from_device(memory_bytes: int, utilization: float, ranks_per_device: int = 1) -> int:
    """A rank's budget as a server sizes it: ``utilization`` (vLLM's ``gpu_memory_utilization``) of the
    device's memory, split between the ranks that share the device."""
    if not 0 < utilization <= 1:
        raise InvalidArgument(f"utilization: need a fraction in (0, 1], got {utilization}")
    return int(memory_bytes * utilization) // ranks_per_device


def resolve_budget(spec: dict[str, Any], resident_bytes: int, reserve_bytes: int, device: Any,
                   ranks_per_device: int) -> int:
    """Bytes per rank for one budget spec as ``bench serve`` gives them: ``{"bytes": B}``, ``{"kv_share": s}``
    (the replicated pool is s of the budget: :func:`budget_for_share`) or ``{"utilization": u,
    "memory_bytes": M or None}`` (M None: the total memory of ``device``, a CUDA device)."""
    if "bytes" in spec:
        return int(spec["bytes"])
    if "kv_share" in spec:
        return budget_for_share(resident_bytes, reserve_bytes, spec["kv_share"])
    memory = spec.get("memory_bytes")
    if memory is None:
        if device.type != "cuda":
            raise InvalidArgument("a budget from a utilization needs the device's memory on CPU ranks (--memory-gib)")
        import torch  # here, not at the top: the command's argument checks import this module without torch

        memory = torch.cuda.get_device_properties(device).total_memory
    return budget_from_device(int(memory), float(spec["utilization"]), ranks_per_device)


def activation_reserve_bytes(model: Any, rows: int, max_len: int) -> int:
    """Bytes set aside for the transient tensors of the largest serving step -- ``rows`` tokens (the
    step's token budget) attending over ``max_len`` (the widest context bucket) -- a stated rule, an
    upper estimate: every row's gathered K and V (``rows x max_len`` tokens of one layer, twice:
    the gather and the attention's copy), the widest projection outputs, the logits in float32, and
    the step's index tensors."""
    cfg = model.cfg
    item = cfg.torch_dtype.itemsize
    attn = model.layers[0].attn
    kv = 2 * rows * max_len * attn.kv_heads * attn.head_dim * item * 2
    widest = max(cfg.dense_inter * 2, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, cfg.shared_inter * 2,
                 cfg.experts * cfg.expert_inter)
    hidden = rows * (4 * cfg.hidden + 2 * widest) * item
    logits = rows * cfg.vocab * (item + 4)
    index = rows * max_len * (8 + 8 + 1)
    return kv + hidden + logits + index
