"""Serving a stream of requests on one rank -- in this process, on the CPU: the paged pool, the
scheduler's decisions on hand-built traces (chunked prefill, admission by blocks, growth, preemption
by recompute), the step's buckets, replay, and the refusals."""

from __future__ import annotations

import pytest
import torch

from wsharding.core.errors import InvalidArgument
from wsharding.linear import process_weights
from wsharding.models import ToyDecoder, decoder_config
from wsharding.models.kv_cache import kv_bytes_per_token
from wsharding.models.serve_step import KVRows
from wsharding.serve import (
    BlockPool,
    Request,
    Scheduler,
    Workload,
    budget_for_share,
    budget_from_device,
    pool_blocks,
    serve,
)
from wsharding.serve.blocks import KVBlocksFull, blocks_for
from wsharding.serve.engine import ServeStalled
from wsharding.serve.scheduler import Scheduled
from wsharding.serve.step import bucket, build_step, context_buckets, token_buckets


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    m = ToyDecoder(decoder_config("tiny")).eval()
    process_weights(m)
    return m


def _pool(blocks: int) -> BlockPool:
    """A pool of one small layer: the scheduler's tests need its blocks, not its bytes."""
    return BlockPool(KVRows(1, 1, 4, torch.float32, (blocks + 1) * 16 - 1, "cpu"))


def _req(rid: int, prompt: int, output: int, arrival: float = 0.0, vocab: int = 192) -> Request:
    g = torch.Generator().manual_seed(rid)
    return Request(rid, 0, arrival, tuple(torch.randint(0, vocab, (prompt,), generator=g).tolist()), output)


def _drive(s: Scheduler, steps: int) -> list[list[tuple[int, int, int]]]:
    """Run the scheduler alone (every sampled token is 7): each step's (rid, start, count)."""
    log = []
    for _ in range(steps):
        scheduled = s.schedule(0.0)
        log.append([(x.seq.request.rid, x.start, x.count) for x in scheduled])
        s.step_done(scheduled, [7] * sum(x.samples for x in scheduled), 0.0)
        if not s.has_work():
            break
    return log


def test_pool_hands_out_whole_blocks_and_keeps_a_scratch_block(model):
    pool = BlockPool.for_model(model, 5)
    assert pool.tokens == 80 and pool.scratch_block == 5 and pool.storage.tokens + 1 == 96
    assert pool.nbytes == 6 * 16 * kv_bytes_per_token(model)  # the scratch block included
    a, b = pool.take(2), pool.take(3)
    assert (a, b) == ([0, 1], [2, 3, 4]) and pool.free_blocks == 0
    with pytest.raises(KVBlocksFull, match="1 KV blocks asked, 0 of 5 free"):
        pool.take(1)
    pool.give_back(a)
    assert pool.take(1) == [0] and pool.used_blocks == 4


def test_budgets_in_blocks_shares_and_utilization():
    # 10,000 - 3,000 - 1,000 B left; blocks of 16 tokens x 10 B = 160 B: 37 of them, one the scratch block
    assert pool_blocks(10_000, 3_000, 1_000, 10) == 36
    with pytest.raises(InvalidArgument, match="leaves no KV pool"):
        pool_blocks(4_300, 3_000, 1_000, 10)
    assert budget_for_share(700, 300, 0.2) == 1250  # the pool is a fifth of it: 1000 / 0.8
    assert budget_from_device(141 * 10**9, 0.9, 2) == 63_450_000_000
    with pytest.raises(InvalidArgument, match="strictly between 0 and 1"):
        budget_for_share(1, 1, 1.0)


def test_chunked_prefill_under_the_token_budget():
    """A 40-token prompt with a budget of 32: its first chunk fills the step; the next step finishes it
    (8 tokens), admits B whole (20) and starts C (4 of 10); then decodes beside C's last 6."""
    s = Scheduler(_pool(6), [_req(0, 40, 3), _req(1, 20, 40), _req(2, 10, 2)], token_budget=32)
    log = _drive(s, 5)
    assert log[:4] == [[(0, 0, 32)],
                       [(0, 32, 8), (1, 0, 20), (2, 0, 4)],
                       [(0, 40, 1), (1, 20, 1), (2, 4, 6)],
                       [(0, 41, 1), (1, 21, 1), (2, 10, 1)]]
    assert log[4] == [(1, 22, 1)]  # A (3 tokens) and C (2) finished in step 3
    assert [q.request.rid for q in s.finished] == [0, 2] and s.pool.used_blocks == 2  # B's 22 tokens: 2 blocks


def test_a_prompt_prefilled_in_chunks_holds_its_blocks_and_no_more():
    """A 64-token prompt (4 blocks) admitted beside a decoding request, 16 tokens a step: it holds its
    4 blocks from its admission on. Without the floor at 0 its second chunk asked blocks_for(32) - 4 =
    -2 blocks, and take(-2) handed out every free block but two: on one H200 the k3-like serve run
    preempted requests with its pool 95 % empty."""
    s = Scheduler(_pool(40), [_req(0, 16, 30), _req(1, 64, 2)], token_budget=16)
    for _ in range(12):
        scheduled = s.schedule(0.0)
        held = sum(len(q.blocks) for q in s.running)
        assert s.pool.used_blocks == held and all(len(q.blocks) <= blocks_for(q.known) for q in s.running)
        s.step_done(scheduled, [7] * sum(x.samples for x in scheduled), 0.0)
    assert s.preemptions == 0
    with pytest.raises(InvalidArgument, match="a count of blocks is >= 0, got -2"):
        s.pool.take(-2)


def test_a_block_given_back_twice_is_refused():
    pool = _pool(4)
    a = pool.take(2)
    pool.give_back(a)
    with pytest.raises(InvalidArgument, match="block 0 is already free"):
        pool.give_back(a)
    with pytest.raises(InvalidArgument, match="block 9 is not one of the pool's 4 blocks"):
        pool.give_back([9])
    assert pool.free_blocks == 4
    # the same block twice in one call, and a refused call that frees nothing of what it was given
    b = pool.take(3)
    with pytest.raises(InvalidArgument, match=f"block {b[0]} is already free"):
        pool.give_back([b[0], b[1], b[0]])
    assert pool.free_blocks == 1
    pool.give_back(b)
    assert pool.free_blocks == 4 and sorted(pool.take(4)) == [0, 1, 2, 3]


def test_growth_block_by_block_and_preemption_of_the_newest_by_recompute():
    """Two requests of 16 + 40 tokens in 4 blocks: each takes a second block at its 17th token; at the
    33rd there is none, so the newest (1) is preempted, and the step admits no one. It waits until 0
    finishes, then recomputes its prompt and its 17 generated tokens in one step."""
    s = Scheduler(_pool(4), [_req(0, 16, 40), _req(1, 16, 40)], token_budget=64)
    log = _drive(s, 100)
    assert log[0] == [(0, 0, 16), (1, 0, 16)] and log[16] == [(0, 31, 1), (1, 31, 1)]
    assert log[17] == [(0, 32, 1)] and s.preemptions == 1 and s.waited_for_memory == {1}
    assert all(step == [(0, 15 + k, 1)] for k, step in enumerate(log[17:40], start=17))
    assert log[40] == [(1, 0, 33)]  # 16 prompt + 17 generated, recomputed
    assert log[41] == [(1, 33, 1)] and len(log) == 63
    seq = next(q for q in s.finished if q.request.rid == 1)
    assert seq.preempted == 1 and len(seq.generated) == 40 and s.pool.free_blocks == 4


def test_first_come_first_served_no_overtaking():
    # the head needs 3 blocks, 2 are free: the one-block request behind it waits too
    s = Scheduler(_pool(4), [_req(0, 30, 8), _req(1, 40, 4), _req(2, 3, 2)], token_budget=128)
    assert [(x.seq.request.rid, x.count) for x in s.schedule(0.0)] == [(0, 30)]
    assert s.waited_for_memory == {1, 2} and [q.request.rid for q in s.waiting] == [1, 2]


def test_a_concurrency_cap_sends_a_request_when_one_finishes():
    s = Scheduler(_pool(8), [_req(0, 4, 1), _req(1, 4, 1), _req(2, 4, 1)], token_budget=64, max_concurrency=2)
    first = s.schedule(0.0)
    assert [x.seq.request.rid for x in first] == [0, 1] and len(s.pending) == 1
    s.step_done(first, [5, 5], 0.25)
    assert [x.seq.request.rid for x in s.schedule(0.5)] == [2]
    assert s.running[0].sent_s == 0.25  # sent when a slot freed, not at its arrival (0)


def test_buckets():
    assert token_buckets(64) == [1, 2, 4, 8, 16, 32, 64] and token_buckets(48)[-2:] == [32, 48]
    assert context_buckets(49) == [16, 32, 64] and context_buckets(16) == [16]
    assert bucket(33, token_buckets(64)) == 64 and bucket(1, token_buckets(64)) == 1


def test_a_step_is_its_tokens_rounded_up_and_reads_its_blocks():
    pool = _pool(8)
    s = Scheduler(pool, [_req(0, 20, 4), _req(1, 3, 4)], token_budget=32)
    built = build_step(pool, s.schedule(0.0), token_buckets(32), context_buckets(64))
    step = built.step
    assert (built.tokens, step.rows, step.max_len) == (23, 32, 32)  # 23 tokens -> 32; context 20 -> 32
    assert built.sample_rows == [19, 22]
    # request 0 owns blocks 0, 1: its token at position 17 is row 16 + 1; request 1's at 2 is block 2's row 2
    assert step.write[17].item() == 17 and step.write[22].item() == 2 * 16 + 2
    # two prefill chunks, each in its own context bucket: request 1 (3 tokens) reads 16, request 0 (20) 32
    assert step.shape == (32, ((1, 4, 16), (1, 32, 32)))
    short, long = step.groups
    assert short.rows[0, :3].tolist() == [20, 21, 22] and short.mask[0, 2].tolist() == [True] * 3 + [False] * 13
    assert long.read[0, 16].item() == 16  # its second block; the short one never reads beyond its first
    assert short.read[0].tolist() == [2 * 16 + i for i in range(16)]
    assert step.write[23:].tolist() == [pool.scratch_block * 16] * 9  # padding writes the scratch block
    # 22 is slot 2 of the first group; the padding rows have no entry (their results are not read)
    assert step.out_index[22].item() == 2 and step.out_index[23:].tolist() == [0] * 9
    assert step.gathered_rows == 1 * 16 + 1 * 32
    idle = build_step(pool, [], token_buckets(32), context_buckets(64))
    assert (idle.tokens, idle.step.rows, idle.sample_rows) == (0, 1, [])


def test_serving_path_computes_the_uncached_forward():
    """The serving path is the same model: a prompt's logits match the uncached forward's (float32, so
    kernels that sum in another order differ only in the last bits)."""
    m = ToyDecoder(decoder_config("tiny").with_(dtype="float32")).eval()
    process_weights(m)
    r = _req(0, 10, 1)
    pool = BlockPool.for_model(m, 2)
    s = Scheduler(pool, [r], token_budget=16)
    with torch.no_grad():
        served = m.forward_serve(build_step(pool, s.schedule(0.0), [16], [16]).step)[:10]
        full = m(torch.tensor(r.prompt))
    assert (served - full).abs().max() < 1e-4


def test_a_prefill_chunk_reads_its_context_once_and_a_mixed_step_computes_its_parts():
    """B and C (5 and 7 prompt tokens) decode in the step where A (12) arrives: 2 decode rows and a
    chunk of 12. A's context is gathered once (a row per row of A gathered it 12 times), and the mixed
    step's logits are those of A's chunk and of the two decodes run as separate steps (float32: within
    the last bits, as the serving path is of the uncached forward)."""
    m = ToyDecoder(decoder_config("tiny").with_(dtype="float32")).eval()
    process_weights(m)
    a = _req(0, 12, 1, arrival=1.0)
    pool = BlockPool.for_model(m, 4)
    s = Scheduler(pool, [a, _req(1, 5, 4), _req(2, 7, 4)], token_budget=16)
    with torch.no_grad():
        first = s.schedule(0.0)
        built = build_step(pool, first, [16], [16])
        s.step_done(first, m.forward_serve(built.step)[built.sample_rows].argmax(-1).tolist(), 0.0)
        mixed = s.schedule(1.0)
        assert [(x.seq.request.rid, x.start, x.count) for x in mixed] == [(1, 5, 1), (2, 7, 1), (0, 0, 12)]
        built = build_step(pool, mixed, token_buckets(16), [16])
        step = built.step
        # decode entries B and C -> a group of 2; one chunk of 12 slots -> 16
        assert step.shape == (16, ((2, 1, 16), (1, 16, 16)))
        assert step.gathered_rows == (2 + 1) * 16 and step.rows * step.max_len == 256  # was: every row's own
        together = m.forward_serve(step)
        chunk = m.forward_serve(build_step(pool, mixed[2:], token_buckets(16), [16]).step)
        decodes = m.forward_serve(build_step(pool, mixed[:2], token_buckets(16), [16]).step)
        full = m(torch.tensor(a.prompt))
    assert (together[2:14] - chunk[:12]).abs().max() < 1e-4 and (together[:2] - decodes[:2]).abs().max() < 1e-4
    assert (together[2:14] - full).abs().max() < 1e-4


def test_serve_and_its_replay(model):
    """Every request gets its tokens, the pool is never over-committed and is empty at the end; a replay
    at the recorded times makes the same steps and gives the same tokens bit for bit."""
    reqs = [_req(i, p, o) for i, (p, o) in enumerate([(9, 7), (30, 11), (12, 3), (7, 20), (5, 9)])]
    pool = BlockPool.for_model(model, 4)
    run = serve(model, pool, reqs, token_budget=16, max_context=48)
    assert {rid: len(v) for rid, v in run.outputs.items()} == {r.rid: r.output for r in reqs}
    assert run.peak_blocks <= 4 and pool.free_blocks == 4 and run.preemptions >= 1
    assert all(b in token_buckets(16) and n <= b for b, n in zip(run.step_bucket, run.step_tokens, strict=True))
    again = serve(model, BlockPool.for_model(model, 4), reqs, token_budget=16, max_context=48,
                  schedule_times=run.schedule_times)
    assert again.outputs == run.outputs and again.step_bucket == run.step_bucket
    assert [r["preempted"] for r in again.records] == [r["preempted"] for r in run.records]


def test_arrivals_are_respected_a_rank_with_nothing_to_compute_waits_free_or_aligned(model, monkeypatch):
    """A request is not scheduled before it arrives; its times count from its arrival. With nothing to
    compute on any rank a rank waits for the arrival and runs no step: free (no ``agree``, a replicated
    rank) and aligned alike (one rank: ``agree`` is the identity) -- an aligned rank pads only while a
    peer computes (the next test)."""
    reqs = [_req(0, 3, 2), _req(1, 2, 2, arrival=0.75)]
    now = [0.0]

    def clock() -> float:  # 0.1 s a reading; a wait moves it on by what was waited
        now[0] += 0.1
        return now[0]

    slept = []
    monkeypatch.setattr("wsharding.serve.engine.time.sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    run = serve(model, BlockPool.for_model(model, 2), reqs, token_budget=8, max_context=4, clock=clock, warmup=0)
    # times since the start (0.1): steps at 0.1 and 0.3 serve request 0; at 0.5 nothing is left to do, the
    # clock reads 0.6 and the rank waits 0.15 s for request 1 (at 0.75) instead of running idle steps
    assert run.step_requests == [1, 1, 1, 1] and run.idle_steps == 0 and slept == [pytest.approx(0.15)]
    assert run.records[1]["token_s"][0] - run.records[1]["sent_s"] == pytest.approx(0.2)
    now[0], slept[:] = 0.0, []
    agreed = []
    aligned = serve(model, BlockPool.for_model(model, 2), reqs, token_budget=8, max_context=4, clock=clock, warmup=0,
                    agree=lambda t: (agreed.append(t), t)[1])
    # before each step the rank says when it has work: 0 (request 0 is due), 0 (it runs), then 0.75 --
    # request 1's arrival: the clock reads 0.6 (0.5 since the start), the rank waits 0.25 s, and steps at
    # 0.85 -- then 0 (request 1 runs), and +inf: nothing left, it stops. Four steps, none idle.
    assert agreed == [0.0, 0.0, 0.75, 0.0, float("inf")]
    assert aligned.step_requests == [1, 1, 1, 1] and aligned.idle_steps == 0 and slept == [pytest.approx(0.25)]
    assert aligned.schedule_times == pytest.approx([0.1, 0.3, 0.85, 1.05])
    assert [r["token_s"][0] - r["sent_s"] for r in aligned.records] == pytest.approx([0.2, 0.2])


def test_an_aligned_rank_pads_only_while_a_peer_computes(model, monkeypatch):
    """A peer (faked in ``agree``) has work for the first three steps, then none: this rank, done with
    request 0 after two steps, runs one idle step for the peer's third, then waits for request 1 with
    no step, as a rank waits when no rank has anything to compute."""
    reqs = [_req(0, 3, 2), _req(1, 2, 2, arrival=5.0)]
    now = [0.0]

    def clock() -> float:
        now[0] += 0.1
        return now[0]

    slept = []
    monkeypatch.setattr("wsharding.serve.engine.time.sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    peer = iter([0.0, 0.0, 0.0] + [float("inf")] * 10)
    run = serve(model, BlockPool.for_model(model, 2), reqs, token_budget=8, max_context=4, clock=clock, warmup=0,
                agree=lambda t: min(t, next(peer)))
    # steps at 0.1, 0.3 (request 0), 0.5 (idle: the peer's third step), then the clock reads 0.8 (0.7 since
    # the start): a wait of 4.3 s to request 1 at 5.0, and its two steps at 5.1 and 5.3
    assert run.step_requests == [1, 1, 0, 1, 1] and run.idle_steps == 1 and slept == [pytest.approx(4.3)]
    assert run.schedule_times == pytest.approx([0.1, 0.3, 0.5, 5.1, 5.3])


def test_a_replay_is_padded_to_the_longest_rank_with_idle_steps(model):
    reqs = [_req(i, p, o) for i, (p, o) in enumerate([(9, 7), (12, 3)])]
    run = serve(model, BlockPool.for_model(model, 4), reqs, token_budget=16, max_context=48)
    again = serve(model, BlockPool.for_model(model, 4), reqs, token_budget=16, max_context=48,
                  schedule_times=run.schedule_times, pad_to=run.steps + 3)
    assert again.outputs == run.outputs and again.steps == run.steps + 3 and again.idle_steps == 3
    assert again.step_tokens[run.steps:] == [0, 0, 0]


def test_admission_takes_the_scheduled_chunks_blocks_not_the_whole_prompts():
    """A 64-token prompt (4 blocks) arrives while a request holds 1 of 4 blocks, 16 tokens a step.
    Admission by the whole prompt (the rule before) waits: 4 blocks > 3 free. By the scheduled chunk
    (vLLM V1) it is admitted with the 1 block its first chunk of 15 tokens needs, and grows a block a
    chunk; at its last chunk there is no block left, so the newest running request -- itself -- stops
    there and is readmitted when the first finishes."""
    s = Scheduler(_pool(4), [_req(0, 10, 20), _req(1, 64, 2, arrival=0.5)], token_budget=16)
    first = s.schedule(0.0)
    s.step_done(first, [7], 0.0)  # request 0's prompt (10 tokens): 1 block
    assert s.pool.used_blocks == 1
    step = s.schedule(1.0)
    assert [(x.seq.request.rid, x.start, x.count) for x in step] == [(0, 10, 1), (1, 0, 15)]
    assert [len(q.blocks) for q in s.running] == [1, 1] and s.pool.used_blocks == 2 and not s.waited_for_memory
    whole = blocks_for(64)
    assert whole == 4 > 4 - 1  # what whole-prompt admission asked: more than the 3 blocks free
    s.step_done(step, [7], 1.0)
    step = s.schedule(1.0)  # its second chunk (15 tokens, to 30): a second block
    assert [(x.seq.request.rid, x.start, x.count) for x in step] == [(0, 11, 1), (1, 15, 15)]
    assert [len(q.blocks) for q in s.running] == [1, 2]
    s.step_done(step, [7], 1.0)
    step = s.schedule(1.0)  # to 45 tokens: a third block, the last free one
    assert [len(q.blocks) for q in s.running] == [1, 3] and s.pool.free_blocks == 0
    s.step_done(step, [7], 1.0)
    step = s.schedule(1.0)  # to 60 tokens needs a fourth: none free, request 1 (the newest) is preempted
    assert [(x.seq.request.rid, x.count) for x in step] == [(0, 1)]
    assert s.preemptions == 1 and s.recomputed_tokens == 45 and [q.request.rid for q in s.waiting] == [1]


def test_in_flight_counts_the_waiting_and_the_running():
    s = Scheduler(_pool(4), [_req(0, 30, 8), _req(1, 40, 4), _req(2, 3, 2)], token_budget=128)
    s.schedule(0.0)
    assert s.in_flight == 3 and len(s.running) == 1


def test_refusals_before_anything_runs(model):
    with pytest.raises(InvalidArgument, match=r"request 1 of rank 0 needs 49 KV tokens .* the whole pool holds 32"):
        serve(model, BlockPool.for_model(model, 2), [_req(0, 5, 5), _req(1, 30, 20)], token_budget=16, max_context=64)
    with pytest.raises(InvalidArgument, match="a step attends over at most 32"):
        serve(model, BlockPool.for_model(model, 8), [_req(0, 30, 20)], token_budget=16, max_context=32)
    with pytest.raises(ServeStalled, match="still working after 3 steps on rank 0"):
        serve(model, BlockPool.for_model(model, 2), [_req(0, 4, 9)], token_budget=8, max_context=16, max_steps=3)


def test_an_aligned_rank_that_can_schedule_nothing_says_so_at_once(model, monkeypatch):
    """A scheduler that sends a request and never schedules it: a free rank says so (no arrival to wait
    for), and so does an aligned one -- at its first such step, not after max_steps padding steps."""
    from wsharding.serve.scheduler import Scheduler

    scheduled = Scheduler.schedule
    monkeypatch.setattr(Scheduler, "schedule", lambda self, now: (scheduled(self, now), [])[1])
    with pytest.raises(ServeStalled, match=r"rank 0 scheduled nothing with 0 waiting and 1 running \(step 0\)"):
        serve(model, BlockPool.for_model(model, 2), [_req(0, 4, 9)], token_budget=8, max_context=16, warmup=0,
              agree=lambda ready_at: ready_at, max_steps=50)


def test_arrivals_are_rescaled_to_the_rate_exactly():
    """The realised rate (requests over the time to the last arrival) equals the label: drawn gaps
    alone offered 2.80/s at a label of 3/s."""
    from wsharding.serve.workload import realised_rate

    for seed in range(5):
        for burstiness in (1.0, 0.5):
            for rank in (0, 1):
                w = Workload(requests=7, rate=3.0, seed=seed, burstiness=burstiness)
                reqs = w.for_rank(rank, 100)
                assert abs(realised_rate(reqs) - 3.0) <= 1e-9 and reqs[-1].arrival_s == 7 / 3.0
                assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs) and reqs[0].arrival_s > 0
    assert realised_rate(Workload(requests=3).for_rank(0, 10)) is None  # all at once


def test_workload_is_seeded_per_rank_bursty_and_round_trips():
    w = Workload(requests=5, prompt=(3, 9), output=(2, 4), rate=10.0, seed=1)
    a, b = w.for_rank(0, 100), w.for_rank(1, 100)
    assert a == w.for_rank(0, 100) and a != b
    assert all(3 <= len(r.prompt) <= 9 and 2 <= r.output <= 4 for r in a)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a) and a[0].arrival_s > 0
    assert Workload.from_dict(w.as_dict()) == w and Workload.from_dict(Workload().as_dict()).rate == float("inf")
    gaps = Workload(requests=2000, rate=4.0, burstiness=0.25).for_rank(0, 10)
    assert gaps[-1].arrival_s / 2000 == 0.25  # the mean gap is 1/rate whatever the shape (rescaled: exactly)
    traced = Workload(requests=6, lengths=((5, 2), (9, 4)), source="t")
    assert traced.prompt == (5, 9) and traced.max_len == 12 and {(len(r.prompt), r.output) for r in traced.for_rank(0, 10)} <= {(5, 2), (9, 4)}
    assert Workload.from_dict(traced.as_dict()) == traced
    with pytest.raises(InvalidArgument, match="prompt lengths"):
        Workload(prompt=(5, 2))
    with pytest.raises(InvalidArgument, match="burstiness"):
        Workload(burstiness=0.0)


def test_scheduled_samples_only_at_the_end_of_its_known_tokens():
    seq = Scheduler(_pool(2), [_req(0, 10, 3)], token_budget=4).schedule(0.0)[0].seq
    assert not Scheduled(seq, 0, 4).samples and Scheduled(seq, 6, 4).samples
