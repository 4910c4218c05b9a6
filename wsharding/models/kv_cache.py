"""The KV-cache pool of the decoder's decode path, sized from the memory left after finalize.

SGLang's weight sharding for Kimi K3 calls ``finalize_model_weight_shard`` right after loading and
*before* the KV-cache pool is sized, so every byte weight sharding gives back is seen by the pool's
sizing and becomes KV cache: more tokens, more concurrent sequences. This module is that last step for
:class:`~wsharding.models.ToyDecoder`:

* :func:`kv_budget_bytes` -- what is free for the pool on this rank now (CUDA: the driver's free memory
  plus what torch's caching allocator holds unused, minus a reserve for activations; optionally under a
  per-process cap; CPU ranks: the machine's available RAM shared by the ranks, an emulation);
* :class:`KVCachePool` -- a simple pool: ``sequences`` slots of ``max_len`` tokens, K and V of every
  layer, ``[layers, sequences, kv_heads, max_len, head_dim]`` each. Sequences of one batch take
  consecutive slots and advance together, so a layer's cache for the batch is a view whose rows are
  contiguous per head (no gather copy, none inside attention either), which is what lets the pool fill
  the memory it was sized for;
* :func:`kv_capacity` -- tokens and sequences of a given length that fit, for a model's KV size.

Per rank under DP attention: every rank holds the K/V of its own sequences for all of its KV heads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from wsharding.core.emulation import CPU_BUDGET_NOTE
from wsharding.core.errors import InvalidArgument, WshardingError


class KVCacheFull(WshardingError, RuntimeError):
    """The pool has no room for the sequences asked for."""


def kv_token_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one token."""
    return layers * 2 * kv_heads * head_dim * dtype.itemsize


def kv_bytes_per_token(model: Any) -> int:
    """K and V of every layer for one token on this rank (the model's own KV heads per rank and dtype)."""
    attn = model.layers[0].attn
    return kv_token_bytes(len(model.layers), attn.kv_heads, attn.head_dim, model.cfg.torch_dtype)


def kv_budget_bytes(device: torch.device, *, reserve_bytes: int = 0, cap_bytes: int | None = None,
                    share: int = 1) -> tuple[int, str]:
    """Bytes free for a KV-cache pool on this rank now, and how that was measured.

    CUDA: ``cudaMemGetInfo``'s free bytes (split between the ``share`` ranks that use this device) plus
    the bytes torch's caching allocator reserved but does not use (its own to hand out again), minus
    ``reserve_bytes`` (activations of the steps that will run). With ``cap_bytes`` (this process's share
    of the GPU, e.g. under ``set_per_process_memory_fraction``) the budget is also at most ``cap_bytes``
    minus what torch has allocated. CPU ranks: ``MemAvailable`` of ``/proc/meminfo`` split between the
    ``share`` ranks of the machine -- labelled an emulation.
    """
    share = max(1, share)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - allocated
        budget = free // share + cached - reserve_bytes
        how = "free GPU memory after finalize (cudaMemGetInfo + torch's cached, unused)"
        if share > 1:
            how += f", split between the {share} ranks on this GPU"
        if cap_bytes is not None:
            budget = min(budget, cap_bytes - allocated - reserve_bytes)
            how += f", under a per-process cap of {cap_bytes / 2**30:.2f} GiB"
        return max(0, budget), how
    return max(0, _mem_available() // share - reserve_bytes), CPU_BUDGET_NOTE


def ranks_sharing_device(world_size: int, device: torch.device) -> int:
    """How many ranks of a one-machine world share ``device``'s memory: all of them on CPU, the ranks per
    GPU on CUDA (several ranks time-slicing one GPU)."""
    if device.type != "cuda":
        return world_size
    return max(1, -(-world_size // max(1, torch.cuda.device_count())))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_capacity(budget_bytes: int, bytes_per_token: int, context: int) -> dict[str, int]:
    """Tokens, and sequences of ``context`` tokens, that a pool of ``budget_bytes`` holds."""
    if bytes_per_token <= 0 or context <= 0:
        raise InvalidArgument(f"kv_capacity: bytes_per_token ({bytes_per_token}) and context ({context}) must be > 0")
    return {"budget_bytes": budget_bytes, "tokens": budget_bytes // bytes_per_token,
            "sequences": budget_bytes // (bytes_per_token * context), "context": context}


def model_bytes(*tensors_or_modules: Any, address_only: set[int] | frozenset[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind the parameters and buffers of modules (and plain tensors):
    a sharded model's slot-bound weights count once, with their slot. ``address_only``: storages (by
    address) that own no memory -- a mapped pool's layer views, over chunks and pages counted as such."""
    seen: dict[int, int] = {}
    for obj in tensors_or_modules:
        ts = list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, torch.nn.Module) else [obj]
        for t in ts:
            st = t.untyped_storage()
            if st.data_ptr() in address_only:
                continue
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


@dataclass
class KVCachePool:
    """``sequences`` slots of ``max_len`` tokens; ``k[layer]`` / ``v[layer]`` are
    ``[sequences, kv_heads, max_len, head_dim]``. Slots are handed out in consecutive runs."""

    k: torch.Tensor
    v: torch.Tensor
    max_len: int
    lengths: list[int] = field(default_factory=list)
    used: list[bool] = field(default_factory=list)

    @classmethod
    def allocate(cls, model: Any, sequences: int, max_len: int, device: torch.device | str | None = None) -> KVCachePool:
        """A pool for ``model`` (its layers, KV heads per rank, head size and dtype)."""
        if sequences < 1 or max_len < 1:
            raise InvalidArgument(f"KVCachePool: sequences ({sequences}) and max_len ({max_len}) must be >= 1")
        attn = model.layers[0].attn
        dev = device if device is not None else model.embed.weight.device
        shape = (len(model.layers), sequences, attn.kv_heads, max_len, attn.head_dim)
        k = torch.empty(shape, dtype=model.cfg.torch_dtype, device=dev)
        v = torch.empty(shape, dtype=model.cfg.torch_dtype, device=dev)
        return cls(k, v, max_len, [0] * sequences, [False] * sequences)

    @classmethod
    def from_budget(cls, model: Any, budget_bytes: int, max_len: int) -> KVCachePool:
        """As many sequences of ``max_len`` tokens as ``budget_bytes`` holds (raises when not one)."""
        n = budget_bytes // (kv_bytes_per_token(model) * max_len)
        if n < 1:
            raise KVCacheFull(f"a KV budget of {budget_bytes} B holds no sequence of {max_len} tokens "
                              f"({kv_bytes_per_token(model)} B per token)")
        return cls.allocate(model, n, max_len)

    @property
    def sequences(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def capacity_tokens(self) -> int:
        return self.sequences * self.max_len

    def add(self, count: int) -> int:
        """Take ``count`` consecutive free slots; returns the first. Raises :class:`KVCacheFull`."""
        run = 0
        for i, busy in enumerate(self.used):
            run = 0 if busy else run + 1
            if run == count:
                first = i - count + 1
                for j in range(first, i + 1):
                    self.used[j], self.lengths[j] = True, 0
                return first
        raise KVCacheFull(f"no {count} consecutive free sequence slots in a pool of {self.sequences} "
                          f"({sum(self.used)} in use): release sequences or size the pool larger")

    def release(self, first: int, count: int) -> None:
        for j in range(first, first + count):
            self.used[j], self.lengths[j] = False, 0

    def layer(self, layer_id: int, first: int, count: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[count, kv_heads, stop, head_dim]`` of K and V of ``layer_id``: slots
        ``[first, first+count)``, tokens ``[0, stop)``."""
        return (self.k[layer_id, first : first + count, :, :stop], self.v[layer_id, first : first + count, :, :stop])


@dataclass(frozen=True)
class KVStep:
    """One cached forward: the batch's slots ``[first, first+count)``, all at position ``start``, and
    ``new`` tokens each (the prefill of a prompt, or 1 to decode)."""

    pool: KVCachePool
    first: int
    count: int
    start: int
    new: int

    def __post_init__(self) -> None:
        if self.start + self.new > self.pool.max_len:
            raise KVCacheFull(f"position {self.start} + {self.new} new tokens passes the pool's max_len "
                              f"{self.pool.max_len}: size the pool for longer sequences")
        lengths = {self.pool.lengths[j] for j in range(self.first, self.first + self.count)}
        if lengths != {self.start}:
            raise InvalidArgument(f"KVStep: slots {self.first}..{self.first + self.count - 1} hold {sorted(lengths)} tokens, "
                             f"the step starts at {self.start}: a batch's sequences advance together")

    def advance(self) -> None:
        """After the step: the batch's sequences hold ``new`` more tokens."""
        for j in range(self.first, self.first + self.count):
            self.pool.lengths[j] = self.start + self.new


def sharded_model_bytes(sharded: torch.nn.Module, ws: Any) -> int:
    """:func:`model_bytes` of a model sharded by ``ws`` (a ``WeightSharding``): its own parameters and
    buffers, the sharding's chunks and the slots' memory; the slot pool's address-only storages (a
    mapped pool's layer views) are not counted."""
    return model_bytes(sharded, *ws.chunks.values(), *ws.slots.resident_buffers(),
                       address_only=ws.slots.address_only_ptrs())


def replicated_vs_sharded(replicated: torch.nn.Module, sharded: torch.nn.Module, ws: Any,
                          *, context: int, reserve_bytes: int = 0, cap_bytes: int | None = None,
                          share: int = 1) -> dict[str, Any]:
    """KV-cache capacity on this rank if only one of the two models were loaded, measured now, after
    finalize, with both resident: the free budget (:func:`kv_budget_bytes`) plus the bytes of the model
    that would not be there (:func:`sharded_model_bytes` for ``sharded``, with ``ws`` its
    ``WeightSharding``). The difference of the two pools is exactly the bytes sharding gave back.
    ``cap_bytes`` on CPU ranks: an emulated memory per rank (the machine's RAM would dwarf the models)."""
    device = replicated.embed.weight.device
    rep, sh = model_bytes(replicated), sharded_model_bytes(sharded, ws)
    if device.type != "cuda" and cap_bytes is not None:
        # CPU ranks under an emulated memory of cap_bytes: what both models and the reserve leave of it.
        # Negative when the two would not fit together -- they never have to: each pool adds back the
        # model that would not be there.
        free = cap_bytes - rep - sh - reserve_bytes
        how = (f"emulated: a memory of {cap_bytes / 2**20:.2f} MiB per CPU rank stands in for a GPU's, "
               "both models and the reserve taken out")
    else:
        free, how = kv_budget_bytes(device, reserve_bytes=reserve_bytes, cap_bytes=cap_bytes, share=share)
    kv = kv_bytes_per_token(sharded)
    return {"measured": how, "free_bytes": free, "reserve_bytes": reserve_bytes, "kv_bytes_per_token": kv,
            "replicated_model_bytes": rep, "sharded_model_bytes": sh, "context": context,
            "replicated": kv_capacity(free + sh, kv, context), "sharded": kv_capacity(free + rep, kv, context)}
