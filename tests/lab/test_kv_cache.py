"""What the saving buys: a KV-cache pool on the decoder's decode path, sized after finalize; the cost
model's prediction of the same for the K3 presets."""

from __future__ import annotations

import pytest
import torch

from wsharding.costmodel import Deployment, estimate, get_device, model_from_dict
from wsharding.lab.tasks.kv import kv_capacity_now, kv_decode_equality
from wsharding.models import PRESETS, ToyDecoder
from wsharding.models.kv_cache import KVCacheFull, KVCachePool, KVStep, kv_bytes_per_token, kv_capacity
from wsharding.presets import load_preset, preset_dict


def test_sharded_decode_equals_replicated(cluster_of):
    cfg = PRESETS["tiny"]
    for r in cluster_of(2).run(kv_decode_equality, "tiny", sequences=3, prompt=5, decode=4):
        assert r["equal"] == [True] * 5          # the prompt, then 4 single-token steps
        assert r["gathers"] == [cfg.layers - 1] * 5
        assert r["lengths"] == [9, 9, 9]
        assert r["kv_bytes_per_token"] == cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 2 == 768
        assert r["pool_bytes"] == 3 * 9 * 768
        assert r["cached_vs_full_max_diff"] < 0.1  # bf16: the cached path is another kernel, same math


def test_capacity_after_finalize_gains_exactly_what_sharding_gave_back(cluster_of):
    for r in cluster_of(2).run(kv_capacity_now, "tiny-deep", context=64):
        gained = r["sharded"]["budget_bytes"] - r["replicated"]["budget_bytes"]
        # the two pools differ by R minus the shards and the two slots, measured from the storages
        assert gained == r["replicated_model_bytes"] - r["sharded_model_bytes"] == r["replicated_bytes"] - r["resident_bytes"]
        assert gained > 0  # 11 sharded layers: the shards give back more than the two slots cost
        kv = r["kv_bytes_per_token"]
        assert r["sharded"]["tokens"] == r["sharded"]["budget_bytes"] // kv
        assert r["sharded"]["sequences"] == r["sharded"]["budget_bytes"] // (kv * 64)
        assert r["sharded"]["tokens"] - r["replicated"]["tokens"] in (gained // kv, gained // kv + 1)
        assert "emulated" in r["measured"]  # CPU ranks: RAM stands in for free GPU memory


def test_pool_refuses_what_does_not_fit():
    model = ToyDecoder(PRESETS["tiny"]).eval()
    pool = KVCachePool.allocate(model, 4, 8)
    assert pool.nbytes == 4 * 8 * kv_bytes_per_token(model)
    first = pool.add(3)
    with pytest.raises(KVCacheFull, match="no 2 consecutive free sequence slots in a pool of 4 \\(3 in use\\)"):
        pool.add(2)
    with pytest.raises(KVCacheFull, match="position 6 \\+ 3 new tokens passes the pool's max_len 8"):
        KVStep(pool, first, 3, 6, 3)
    with pytest.raises(ValueError, match="slots 0..2 hold \\[0\\] tokens, the step starts at 2"):
        KVStep(pool, first, 3, 2, 1)
    with pytest.raises(ValueError, match="tokens \\[3, 2\\] do not match the step's 3 sequences x 1 new tokens"):
        model.forward_cached(torch.zeros(3, 2, dtype=torch.long), KVStep(pool, first, 3, 0, 1))
    pool.release(first, 3)
    assert pool.add(4) == 0
    with pytest.raises(KVCacheFull, match="holds no sequence of 8 tokens"):
        KVCachePool.from_budget(model, 8 * kv_bytes_per_token(model) - 1, 8)
    assert kv_capacity(10_000, 100, 7) == {"budget_bytes": 10_000, "tokens": 100, "sequences": 14, "context": 7}


# ---- the cost model: the same prediction for the K3 presets ----------------------------------------
def b200(ranks: int = 8, **kw) -> Deployment:
    return Deployment(ranks=ranks, device=get_device("b200"), tokens=256, **kw)


def test_k3_moe_bf16_kv_capacity():
    cap = estimate(load_preset("kimi-k3-b200-moe-bf16"), b200()).kv_capacity()
    pool, net, kv = 40 * 2**30, 28_809_499_136, 23 * (512 + 64) * 2  # net saving: test_costmodel's exact figure
    assert kv == 26_496
    assert cap == {"pool_bytes_replicated": pool, "pool_bytes_sharded": pool + net,
                   "tokens_replicated": 1_620_987, "tokens_sharded": 2_708_302, "context": 8192,
                   "sequences_replicated": 197, "sequences_sharded": 330}
    assert cap["tokens_replicated"] == pool // kv and cap["tokens_sharded"] == (pool + net) // kv


def test_k3_fp8_kv_capacity_and_overrides():
    plan = estimate(load_preset("kimi-k3-b200-fp8"), b200())
    cap = plan.kv_capacity()
    assert cap["tokens_sharded"] - cap["tokens_replicated"] in (plan.extra_kv_tokens, plan.extra_kv_tokens + 1)
    assert (cap["sequences_replicated"], cap["sequences_sharded"]) == (197, 403)
    mine = estimate(load_preset("kimi-k3-b200-fp8"), b200(kv_pool_bytes=10 * 2**30, context=4096)).kv_capacity()
    assert mine["tokens_replicated"] == 10 * 2**30 // 26_496 and mine["context"] == 4096
    assert "kv_capacity" in plan.to_dict()
    bare = model_from_dict({**preset_dict("kimi-k3-b200-fp8"), "kv_bytes_per_token": None})
    assert estimate(bare, b200()).kv_capacity() is None  # no KV size: nothing to predict


def test_an_emulated_memory_per_cpu_rank_sizes_both_pools(cluster_of):
    """With ``cap_bytes`` a CPU rank's memory is a stated number, not the machine's RAM: each pool is
    that memory less its own model and the reserve, so the gain is a visible share of the pool."""
    cap, reserve = 5 << 19, 1 << 18  # 2.5 MiB per rank, 0.25 MiB of it for activations
    for r in cluster_of(2).run(kv_capacity_now, "tiny-deep", context=64, cap_bytes=cap, reserve_bytes=reserve):
        kv = r["kv_bytes_per_token"]
        assert r["replicated"]["tokens"] == (cap - r["replicated_model_bytes"] - reserve) // kv
        assert r["sharded"]["tokens"] == (cap - r["sharded_model_bytes"] - reserve) // kv
        assert r["sharded"]["tokens"] > 1.2 * r["replicated"]["tokens"]
        assert r["measured"].startswith("emulated: a memory of 2.50 MiB per CPU rank")
