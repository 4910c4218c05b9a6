"""Load peaks on CPU ranks, checked against bounds computed here from the config alone.

Row-shard loading (BF16, ModelOpt FP8): R/N <= peak <= R/N + padding/N + two slots + one tensor (the
largest tensor read whole, or one weight gathered at finalize). Block FP8 is requant-then-shard:
its peak is not reduced (>= R, above the row-shard bound). On CPU ranks the device is host memory:
the numbers are the resident set, and say so."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from wsharding.lab.tasks.loading import load_variant
from wsharding.models import variant_config

N = 2
ITEMSIZE = {"F8_E4M3": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4}
COUNTS = [[3, 2]]


def bill(cfg, itemsize: int) -> dict[str, int]:
    """R, the two slots and the sum of the chunks, by hand: entries 16-byte aligned, layer padded to 16 N."""
    h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (cfg.latent, h), (h, cfg.latent), (2 * cfg.shared_inter, h),
              (h, cfg.shared_inter)]
    end = 0
    for r, c in shapes:
        end = -(-end // 16) * 16 + r * c * itemsize
    total = -(-end // (16 * N)) * 16 * N
    layers = cfg.layers - 1
    payload = sum(r * c for r, c in shapes) * itemsize
    return {"R": payload * layers, "chunks": total // N * layers, "slots": 2 * total}


@pytest.mark.parametrize("variant, itemsize", [("bf16", 2), ("fp8", 1), ("fp8_block", 1)])
def test_load_peak_within_bounds(cluster_of, tmp_path, variant, itemsize):
    path = tmp_path / f"{variant}.safetensors"
    results = cluster_of(N).run(load_variant, "small", variant, str(path), COUNTS)
    b = bill(variant_config("small", variant), itemsize)
    with safe_open(str(path), framework="pt") as f:  # the largest tensor of the file (safetensors' own reader)
        largest = max(math.prod(f.get_slice(k).get_shape()) * ITEMSIZE[f.get_slice(k).get_dtype()] for k in f.keys())
    row_bound = b["chunks"] + b["slots"] + largest  # R/N + padding/N + two slots + one tensor
    for r in results:
        p = r["load_peak"]
        assert r["equal"] == [True]
        assert r["replicated_bytes"] == b["R"] and r["formula_bytes"] == b["chunks"] + b["slots"]
        assert p["device_is_host"] and p["host_exact"] and p["device_peak_bytes"] == p["host_peak_bytes"]
        if variant == "fp8_block":
            assert p["held_bytes"] == b["R"]  # full-shape weights before finalize
            assert p["device_peak_bytes"] >= b["R"]  # not reduced ...
            assert p["device_peak_bytes"] > row_bound  # ... and above what row-shard loading needs
        else:
            assert p["held_bytes"] == b["R"] // N  # only this rank's rows exist before finalize
            assert b["R"] // N <= p["device_peak_bytes"] <= row_bound


class _FakeCudaAllocator:
    """torch.cuda's allocator counters, driven by hand: what finalize does to them, layer by layer."""

    def __init__(self, allocated: int) -> None:
        self.now = self.peak = allocated

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.now)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: setattr(self, "peak", self.now))


@pytest.mark.parametrize("sampled", [True, False])
def test_peak_beside_an_outside_allocator_is_not_counted_twice(monkeypatch, sampled):
    """[Note: two allocators]: two layers of 50-byte row shards (torch) become 50-byte chunks
    (ncclMemAlloc, outside torch); a 10-byte temporary per layer. The true peak of the sharded weights
    is 100 + 20 (slots) + 10 = 130; without the samples the meter adds every chunk to torch's peak."""
    from wsharding.memory import PeakMeter

    torch_mem, outside = _FakeCudaAllocator(100), [0]
    torch_mem.install(monkeypatch)
    sample = (lambda m: m.sample()) if sampled else (lambda m: None)
    with PeakMeter("cuda", held_bytes=100, outside_allocator=lambda: outside[0]) as meter:
        outside[0] += 20  # the two slots
        for _ in range(2):
            torch_mem.alloc(-50)  # this layer's rows are packed into a slot, its row shard freed
            sample(meter)  # "rows packed"
            outside[0] += 50  # the chunk
            sample(meter)  # "chunk"
            torch_mem.alloc(10)  # gather / after-loading temporary
            torch_mem.alloc(-10)
            sample(meter)  # "done"
    assert meter.result.device_peak_bytes == (130 if sampled else 100 + 120)
