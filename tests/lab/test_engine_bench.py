"""``wsharding bench serve --engine transformers`` on 2 CPU ranks (gloo; a tiny Llama built from a config,
no network): the same workload, budget and SLO as the package's own scheduler, both variants on the same
arrivals, every token equal, and the engine's KV pool exactly the blocks the budget leaves.

The guards beside it: the pool in whole engine sectors (the engine rounds a pool that is not up, so
the pool served would not be the pool reported), the engine's cache read back once built, the options
the engine run does not take refused, and the agreement made over our NCCL communicator's names."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from wsharding.core.errors import InvalidArgument, Unsupported  # noqa: E402
from wsharding.engines.cb_budget import (  # noqa: E402
    blocks_per_sector,
    check_engine_pool,
    engine_pool_blocks,
    kv_block_bytes,
)
from wsharding.lab.bench.serve_engine import format_engine_table, run_engine_bench  # noqa: E402
from wsharding.serve.metrics import SLO  # noqa: E402
from wsharding.serve.workload import Workload  # noqa: E402

BUDGET = 1_500_000


def test_engine_bench_end_to_end(cluster_of):
    """3 requests per rank at 50/s, one trial, a budget of 1,500,000 B per rank. The tiny Llama (6 layers,
    hidden 64, 2 KV heads of 16, float32): a block is 2 (K, V) x 16 tokens x 2 heads x 16 x 4 B x 6 layers =
    24,576 B. Replicated it holds 1,019,200 B (6 layers of 147,456 B, embedding and head of 65,536 B each,
    norms 3,328 B, rotary buffers 64 B); sharded over 2 ranks 871,744 B (half of each layer, two slots of a
    layer). The reserve (engine_reserve_bytes at 32 batch tokens, 8 requests of 14 tokens) is 256,256 B. So
    replicated (1,500,000 - 1,019,200 - 256,256) // 24,576 - 2 trash sectors = 9 - 2 = 7 blocks, sharded
    (1,500,000 - 871,744 - 256,256) // 24,576 - 2 = 15 - 2 = 13 blocks; the engine built exactly those."""
    wl = Workload(requests=3, prompt=(4, 8), output=(2, 6), rate=50.0)
    slo = SLO(ttft_ms=5000, tpot_ms=1000)
    report = run_engine_bench(2, "tiny", wl, budgets=[BUDGET], rates=[50.0], trials=1, slo=slo, warmup=0,
                              cluster=cluster_of(2), max_batch_tokens=32, max_requests=8)
    assert report["block_bytes"] == 24_576
    assert report["sizing"] == {"replicated": {"resident_bytes": 1_019_200, "reserve_bytes": 256_256},
                                "sharded": {"resident_bytes": 871_744, "reserve_bytes": 256_256}}
    row = report["rows_by_budget"][0]
    assert (row["replicated"]["pool_blocks"], row["sharded"]["pool_blocks"]) == (7, 13)
    assert (row["replicated"]["pool_tokens"], row["sharded"]["pool_tokens"]) == (112, 208)
    # the token check ran and found every request of every rank equal, bit for bit
    assert report["checked"] and report["equal"] and report["differ"] == []
    point = row["points"][0]
    for v in ("replicated", "sharded"):
        assert point[v]["measured"]["mean"] == 6  # 3 requests x 2 ranks, no warm-up
        assert point[v]["attainment"]["mean"] == 1.0
        assert point[v]["preemptions"]["mean"] == 0  # 13 and 7 blocks hold 3 requests of <= 13 tokens each
    assert point["replicated"]["idle_steps"]["mean"] == 0  # free: no dummy step
    # both judged over the same arrival window: equal attainment gives equal goodput
    assert point["sharded"]["goodput"]["mean"] == point["replicated"]["goodput"]["mean"]
    assert point["sharded"]["window_s"]["mean"] == point["replicated"]["window_s"]["mean"]
    text = format_engine_table(report)
    assert "NOTE: emulated" in text and "CPU ranks: the budgets are emulated" in text
    assert "KV pool replicated 7 blocks = 112 tokens" in text and "sharded 13 blocks = 208 tokens" in text
    assert "every token equal on every rank" in text
    for v, pool in (("replicated", 7), ("sharded", 13)):  # each rank's pool held some blocks, never more than it has
        assert 0 < point[v]["kv_peak_blocks"]["max"] <= pool
        assert point[v]["kv_peak_blocks"]["by_trial"] == [point[v]["kv_peak_blocks"]["max"]]
    assert "KV peak/pool" in text and "not reported by this engine: waited_for_memory" in text
    assert "peak_blocks" not in report["missing"]


def test_the_engine_counts_its_peak_blocks_exactly():
    """One rank, three requests queued before the engine starts (one batch: 80 prompt tokens of at most 256):
    prompts of 10, 30 and 40 tokens and outputs of 20, 20 and 5. The third ends at 44 tokens (3 blocks of 16)
    while the first holds 14 (1) and the second 34 (3): 7 blocks, the most at once; then 2 + 4 = 6. A count
    one block off (6) fails it."""
    import torch

    from wsharding.engines.transformers_cb import AlignedEngine
    from wsharding.lab.tasks.engine_bench import build, engine_configs, llama_config

    one_rank = SimpleNamespace(rank=0, world_size=1, group=None, group_ranks=None, timeout=None)
    model = build(llama_config("tiny"), 0, torch.device("cpu"))
    for blocks in (20, 40):  # the peak is the requests', not the pool's
        gen, cb = engine_configs(20, blocks, 16, 256, 8)
        engine = AlignedEngine(model, one_rank, generation_config=gen, cb_config=cb)
        for i, (prompt, out) in enumerate([(10, 20), (30, 20), (40, 5)]):
            engine.add_request(list(range(1, prompt + 1)), max_new_tokens=out, request_id=f"r{i}")
        engine.start()
        try:
            engine.results([f"r{i}" for i in range(3)])
        finally:
            engine.stop()
        assert engine.counters.kv_peak_blocks == 7


def _tiny_odd_model(dtype_name: str = "bfloat16"):
    """A 1-layer Llama whose engine block is 2 x 4 tokens x 1 KV head x 6 x 2 B = 96 B: not a multiple of the
    engine's 128 B sector alignment, so a sector holds lcm(96, 128) / 96 = 4 blocks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(getattr(torch, dtype_name)).eval()


def _built_engine(model, num_blocks: int):
    from wsharding.lab.tasks.engine_bench import engine_configs

    gen, cb = engine_configs(2, num_blocks, page_size=4, max_batch_tokens=8, max_requests=2)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.warmup()  # builds the cache
    return manager


def test_the_pool_is_whole_engine_sectors():
    """The guard's reason: asked for 10 blocks of 96 B, the engine builds 3 sectors of 4 = 12 blocks (a pool
    the report would not describe); engine_pool_blocks gives whole sectors, which the engine builds as asked,
    and check_engine_pool refuses the 10."""
    import torch

    model = _tiny_odd_model()
    block = kv_block_bytes(model.config, 4, torch.bfloat16)
    assert block == 96 and blocks_per_sector(block) == 4
    # 2,000 B less 500 B of weights and 100 B of reserve: 1,400 // 384 = 3 sectors, less the 2 trash sectors
    assert engine_pool_blocks(2_000, 500, 100, block) == 4
    assert engine_pool_blocks(5_000, 500, 100, block) == 36  # 4,400 // 384 = 11 sectors - 2 = 9 sectors of 4
    manager = _built_engine(model, 10)
    assert manager.batch_processor.cache.num_blocks == 12
    with pytest.raises(Unsupported, match=r"the engine's cache is 12 blocks of 96 B, the budget sized 10 blocks"):
        check_engine_pool(manager, 10, block)
    check_engine_pool(_built_engine(model, 12), 12, block)


def test_another_block_layout_is_refused():
    """A transformers whose block held other bytes than kv_block_bytes says (here: a wrong guess of 95 B)
    is refused once the cache is built, naming both."""
    model = _tiny_odd_model()
    with pytest.raises(Unsupported, match=r"12 blocks of 96 B, the budget sized 12 blocks of 95 B"):
        check_engine_pool(_built_engine(model, 12), 12, 95)


def test_engine_options_refused():
    """Options of bench serve that the engine run does not take fail in one line, before any rank starts."""
    from wsharding.lab.args.bench_serve import add_arguments
    from wsharding.lab.bench.serve import main

    p = argparse.ArgumentParser()
    add_arguments(p)
    for extra, name in ((["--plain"], "--plain"), (["--predict"], "--predict"), (["--max-concurrency", "2"],
                                                                                 "--max-concurrency")):
        with pytest.raises(InvalidArgument, match=f"--engine transformers does not take {name}"):
            main(p.parse_args(["--engine", "transformers", "--json", "", *extra]))


def agreement_over(ctx, names: str) -> dict:
    """Rank task: a StepAgreement made from a communicator that knows its group as ours (NCCL) does --
    ``group_ranks`` and a ``timeout``, no process group -- or as the torch backend does, then one round."""
    from datetime import timedelta

    from wsharding.engines.transformers_cb import StepAgreement

    comm = SimpleNamespace(rank=ctx.rank, world_size=ctx.world_size, group=None, group_ranks=(0, 1),
                           timeout=timedelta(seconds=10))
    if names == "torch":
        comm = SimpleNamespace(rank=ctx.rank, world_size=ctx.world_size, group=None, group_ranks=(), timeout=None)
    a = StepAgreement(comm)
    return {"rank": ctx.rank, "round": a.reduce(ctx.rank == 0, True, False)}


def test_agreement_over_our_nccl_names(cluster_of):
    """Where ranks share one GPU the sharded model gathers with our NCCL communicator, which has no process
    ``group``: the engine's agreement takes its ``group_ranks`` and ``timeout`` (one rank with work, two
    staying, none failed)."""
    for names in ("nccl", "torch"):
        assert [r["round"] for r in cluster_of(2).run(agreement_over, names)] == [(1, 2, 0), (1, 2, 0)]


def test_ranks_that_sized_other_pools_are_refused():
    """Every rank sizes its pool from the same budget and the same model: a rank that got another pool
    (another build, another transformers) would make the pair's pool ratio a mix; the report refuses it."""
    from wsharding.lab.bench.serve_engine import summarize_engine

    r0 = {"rank": 0, "workload": {"requests": 3}, "pools": {"replicated": [7], "sharded": [13]}}
    r1 = {**r0, "rank": 1, "pools": {"replicated": [7], "sharded": [12]}}
    with pytest.raises(InvalidArgument, match=r"rank 1 sized other pools than rank 0"):
        summarize_engine([r0, r1], warmup=0)


def test_a_pool_too_small_for_the_longest_request_is_refused(cluster_of):
    """A request longer than the smaller pool would wait in the engine's queue for ever: refused on every
    rank, before any engine starts, naming the blocks. (Budget 1,670,000 B, a reserve of 519,680 B for
    contexts of 56 tokens: the replicated pool is (1,670,000 - 1,019,200 - 519,680) // 24,576 - 2 = 3 blocks
    of 16 tokens; the longest request, 24 + 32 tokens, needs 4.)"""
    from wsharding.lab.cluster import RemoteError

    wl = Workload(requests=3, prompt=(24, 24), output=(32, 32), rate=50.0)
    with pytest.raises(RemoteError, match=r"the workload's longest request needs 4 blocks of 16 tokens, the smallest "
                                          r"pool has 3"):
        run_engine_bench(2, "tiny", wl, budgets=[1_670_000], rates=[50.0], cluster=cluster_of(2),
                         max_batch_tokens=32, max_requests=8)


def engine_bench_other_weights(ctx, **kwargs) -> dict:
    """Rank task: :func:`~wsharding.lab.tasks.engine_bench.engine_bench_rank` with the sharded model built
    from another seed than the replicated one (its second build), so that their tokens differ."""
    from wsharding.lab.tasks import engine_bench

    real, calls = engine_bench.build, []

    def build(config, seed, device):
        calls.append(seed)
        return real(config, seed + len(calls) - 1, device)

    engine_bench.build = build
    try:
        return engine_bench.engine_bench_rank(ctx, "tiny", **kwargs)
    finally:
        engine_bench.build = real


def test_the_token_check_finds_other_tokens(cluster_of):
    """The check is not vacuous: a sharded model of other weights gives other tokens, which the report
    names per rank (the command then raises EngineMismatch after printing it)."""
    from wsharding.lab.bench.serve_engine import summarize_engine

    wl = Workload(requests=3, prompt=(4, 8), output=(4, 6), rate=50.0)
    results = cluster_of(2).run(engine_bench_other_weights, workload=wl.as_dict(), budgets=[{"bytes": BUDGET}],
                                rates=[50.0], max_batch_tokens=32, max_requests=8)
    report = summarize_engine(results, warmup=0)
    assert not report["equal"]
    assert sorted(d["rank"] for d in report["differ"]) == [0, 1]
    assert all(d["requests"] == [0, 1, 2] for d in report["differ"]), report["differ"]
    assert "TOKENS DIFFER in the check: rank 0 requests [0, 1, 2]" in format_engine_table(report)
