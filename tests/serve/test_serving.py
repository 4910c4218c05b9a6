"""Serving a stream of requests on one rank: the token pool, admission, the fixed step shape, greedy
tokens, and the refusals -- in this process, on the CPU."""

from __future__ import annotations

import pytest
import torch

from wsharding.core.errors import InvalidArgument
from wsharding.linear import process_weights
from wsharding.models import ToyDecoder, decoder_config
from wsharding.models.kv_cache import kv_bytes_per_token
from wsharding.models.token_pool import KVPoolFull, TokenKVPool
from wsharding.serve import ContinuousBatcher, Request, Workload, pool_tokens, serve
from wsharding.serve.engine import percentile


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    m = ToyDecoder(decoder_config("tiny")).eval()
    process_weights(m)
    return m


def _requests(spec: list[tuple[int, int]], vocab: int = 192, rank: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(5)
    return [Request(i, rank, 0.0, tuple(torch.randint(0, vocab, (p,), generator=g).tolist()), o)
            for i, (p, o) in enumerate(spec)]


def test_pool_hands_out_exactly_its_tokens(model):
    pool = TokenKVPool.for_model(model, 10)
    a, b = pool.take(4), pool.take(6)
    assert sorted(a + b) == list(range(10)) and pool.free_tokens == 0
    with pytest.raises(KVPoolFull, match="1 KV tokens asked, 0 of 10 free"):
        pool.take(1)
    pool.give_back(a)
    assert pool.free_tokens == 4 and pool.used_tokens == 6
    assert pool.nbytes == 11 * kv_bytes_per_token(model)  # the scratch row included


def test_admission_never_exceeds_the_pool(model):
    # Four requests of 12 KV tokens each (8 prompt + 5 output - 1), a pool of 30: two fit at once, never three.
    reqs = _requests([(8, 5)] * 4)
    pool = TokenKVPool.for_model(model, 30)
    used = []
    inner = model.forward_serve

    class Watch(torch.nn.Module):
        def forward_serve(self, step):
            used.append(pool.used_tokens)
            return inner(step)

    run = serve(Watch(), pool, reqs, rows=32, max_len=12)
    assert max(used) == 24 <= pool.tokens
    assert max(run.concurrency) == 2 and run.peak_kv_tokens == 24
    assert run.waited_for_memory == 2  # the last two waited until the first two finished
    assert pool.free_tokens == 30  # every sequence gave its tokens back
    assert sorted(run.outputs) == [0, 1, 2, 3] and all(len(v) == 5 for v in run.outputs.values())


def test_first_come_first_served_no_overtaking(model):
    # The head (20 KV tokens) does not fit beside the running one; the small one behind it must wait too.
    reqs = _requests([(10, 6), (15, 6), (2, 2)])
    pool = TokenKVPool.for_model(model, 25)
    b = ContinuousBatcher(pool, reqs, rows=32, max_len=20, device="cpu")
    b.next_step(0.0)
    assert [s.request.rid for s in b.running] == [0]
    assert b.waited_for_memory == {1, 2}  # the small one fits, yet waits behind the head
    assert [r.rid for r in b.pending] == [1, 2]


def test_rows_limit_admission(model):
    reqs = _requests([(6, 3)] * 3)
    b = ContinuousBatcher(TokenKVPool.for_model(model, 100), reqs, rows=13, max_len=8, device="cpu")
    step = b.next_step(0.0)
    assert len(b.running) == 2 and b.waited_for_rows == {2}  # 6 + 6 rows of prompts; 6 more would be 18 > 13
    assert step.rows == 13 and step.max_len == 8
    # padding rows write the scratch row and attend to it alone
    assert step.write[12].item() == step.pool.scratch and step.mask[12].tolist() == [True] + [False] * 7


def test_greedy_tokens_do_not_depend_on_the_company(model):
    """A request's tokens are the same served alone, in a crowd, with a small or a large pool."""
    reqs = _requests([(9, 7), (4, 11), (12, 3), (7, 7), (5, 9)])
    alone = {}
    for r in reqs:
        run = serve(model, TokenKVPool.for_model(model, 40), [Request(r.rid, 0, 0.0, r.prompt, r.output)], rows=16,
                    max_len=16)
        alone[r.rid] = run.outputs[r.rid]
    for tokens in (16, 40, 200):
        assert serve(model, TokenKVPool.for_model(model, tokens), reqs, rows=16, max_len=16).outputs == alone


def test_serving_path_computes_the_uncached_forward():
    """The serving path is the same model: a prompt's logits match the uncached forward's (float32, so
    kernels that sum in another order differ only in the last bits)."""
    m = ToyDecoder(decoder_config("tiny").with_(dtype="float32")).eval()
    process_weights(m)
    reqs = _requests([(10, 1)])
    b = ContinuousBatcher(TokenKVPool.for_model(m, 20), reqs, rows=16, max_len=10, device="cpu")
    with torch.no_grad():
        served = m.forward_serve(b.next_step(0.0))[:10]
        full = m(torch.tensor(reqs[0].prompt))
    assert (served - full).abs().max() < 1e-4


def test_attention_width_is_fixed_because_it_changes_bits(model):
    """The guard behind the fixed step shape: the same request attended over a wider padded window gives
    other logits (another summation), so the width must not follow the batch."""
    reqs = _requests([(12, 1)])
    outs = []
    for width in (12, 40):
        b = ContinuousBatcher(TokenKVPool.for_model(model, 50), reqs, rows=16, max_len=width, device="cpu")
        with torch.no_grad():
            outs.append(model.forward_serve(b.next_step(0.0))[:12])
    assert not torch.equal(outs[0], outs[1])


def test_request_longer_than_the_pool_is_refused_before_anything_runs(model):
    reqs = _requests([(5, 5), (30, 20)], rank=3)
    with pytest.raises(InvalidArgument, match=r"request 1 of rank 3 needs 49 KV tokens .* the whole pool holds 40"):
        serve(model, TokenKVPool.for_model(model, 40), reqs, rows=64, max_len=49)
    with pytest.raises(InvalidArgument, match="prompt of 30 tokens does not fit in a step of 16 rows"):
        serve(model, TokenKVPool.for_model(model, 100), reqs, rows=16, max_len=49)


def test_pool_tokens_is_budget_minus_resident_minus_reserve():
    assert pool_tokens(10_000, 3_000, 1_000, 100) == 59  # 60 rows of 100 B, one of them the scratch row
    with pytest.raises(InvalidArgument, match="leaves no KV pool"):
        pool_tokens(4_000, 3_000, 1_000, 100)


def test_workload_is_seeded_per_rank_and_round_trips():
    w = Workload(requests=5, prompt=(3, 9), output=(2, 4), rate=10.0, seed=1)
    a, b = w.for_rank(0, 100), w.for_rank(1, 100)
    assert a == w.for_rank(0, 100) and a != b
    assert all(3 <= len(r.prompt) <= 9 and 2 <= r.output <= 4 for r in a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a) and a[0].arrival_s > 0
    assert Workload.from_dict(w.as_dict()) == w
    assert Workload.from_dict(Workload().as_dict()).rate == float("inf")
    with pytest.raises(InvalidArgument, match="prompt lengths"):
        Workload(prompt=(5, 2))


def test_arrivals_are_respected(model):
    """A request is not admitted before it arrives: TTFT is measured from its arrival."""
    reqs = [Request(0, 0, 0.0, (1, 2, 3), 2), Request(1, 0, 0.75, (4, 5), 2)]
    ticks = iter(range(100))
    run = serve(model, TokenKVPool.for_model(model, 20), reqs, rows=8, max_len=4, clock=lambda: next(ticks) / 10, warmup=0)
    # a step reads the clock twice (admission, then its tokens): steps admit at 0.1, 0.3, 0.5, 0.7, 0.9 s
    assert run.concurrency == [1, 1, 0, 0, 1, 1]  # request 1 arrives at 0.75 s: dummy steps until then
    assert run.ttft_s == pytest.approx([0.2, 0.25])  # from arrival to the end of its prefill step


def test_percentile_nearest_rank():
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0
    assert percentile([], 99) is None


def test_a_loop_that_never_ends_is_stopped_with_an_error(model):
    from wsharding.serve.engine import ServeStalled

    with pytest.raises(ServeStalled, match="still working after 3 steps on rank 0"):
        serve(model, TokenKVPool.for_model(model, 40), _requests([(4, 9)]), rows=8, max_len=12, max_steps=3)
