"""One KV pool reused by every trial of a budget (``bench serve`` keeps one per variant and budget, as
its CUDA graphs are tied to it): reset before each trial, a trial on the reused pool serves the same
tokens, bit for bit, and the same block tables as one on a fresh pool; without the reset it would be
handed other blocks over an earlier trial's K/V. Tiny preset, CPU, in this process."""

from __future__ import annotations

import pytest
import torch

from wsharding.linear import process_weights
from wsharding.models import ToyDecoder, decoder_config
from wsharding.serve import BlockPool, Workload, serve
from wsharding.serve.runner import StepRunner
from wsharding.serve.step import context_buckets

BLOCKS = 10  # small enough that the trials wait for memory and preempt: block tables churn
WL = Workload(requests=5, prompt=(6, 40), output=(3, 12))


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    m = ToyDecoder(decoder_config("tiny")).eval()
    process_weights(m)
    return m


def _trial(model: ToyDecoder, runner: StepRunner, seed: int):
    reqs = WL.with_(seed=seed).for_rank(0, model.cfg.vocab)
    return serve(model, runner.pool, reqs, token_budget=16, max_context=context_buckets(WL.max_len)[-1],
                 runner=runner)


def test_a_trial_on_a_reset_pool_gives_a_fresh_pools_tokens_bit_for_bit(model):
    reused = StepRunner(model, BlockPool.for_model(model, BLOCKS), graphs=False)
    first = _trial(model, reused, seed=1)
    assert first.outputs and first.peak_blocks > 0
    storage = (reused.pool.storage.k, reused.pool.storage.v)
    reused.pool.reset()
    again = _trial(model, reused, seed=2)
    fresh = _trial(model, StepRunner(model, BlockPool.for_model(model, BLOCKS), graphs=False), seed=2)
    assert again.outputs == fresh.outputs and sum(len(t) for t in fresh.outputs.values()) > 0
    assert again.step_blocks == fresh.step_blocks and again.step_tokens == fresh.step_tokens
    assert (again.preemptions, again.waited_for_memory) == (fresh.preemptions, fresh.waited_for_memory)
    # in place: a graph captured on the pool holds these tensors' addresses
    assert reused.pool.storage.k is storage[0] and reused.pool.storage.v is storage[1]
    assert reused.counts()["eager_steps"] == first.steps + again.steps


def test_the_reset_clears_what_a_stale_trial_would_read(model):
    """What the reset guards: after a trial every block is free again, but not in a fresh pool's order,
    and its K/V rows still hold the trial's values -- the next trial would be handed other blocks (its
    block table reading the earlier trial's rows at masked positions)."""
    pool = BlockPool.for_model(model, BLOCKS)
    _trial(model, StepRunner(model, pool, graphs=False), seed=1)
    fresh = BlockPool.for_model(model, BLOCKS)
    assert pool.free_blocks == fresh.free_blocks == BLOCKS  # every sequence gave its blocks back ...
    assert torch.count_nonzero(pool.storage.k) > 0 and torch.count_nonzero(pool.storage.v) > 0  # ... not its K/V
    stale = BlockPool.for_model(model, BLOCKS)
    stale.storage, stale._free = pool.storage, list(pool._free)  # the pool as a trial without the reset sees it
    assert stale.take(BLOCKS) != fresh.take(BLOCKS)  # another block table than a fresh pool's
    fresh.give_back(list(range(BLOCKS)))
    pool.reset()
    assert torch.count_nonzero(pool.storage.k) == 0 and torch.count_nonzero(pool.storage.v) == 0
    assert pool.take(BLOCKS) == fresh.take(BLOCKS) == list(range(BLOCKS))
    pool.give_back([3])
    pool.reset()  # blocks still handed out when reset: all free again, none twice
    assert pool.free_blocks == BLOCKS and pool.take(BLOCKS) == list(range(BLOCKS))
