"""The serving step's attention groups (each sequence reads its own context bucket), the step runner
(eager on CPU, and says so), the step timer, and the sharded model against the replicated one on CPU
ranks through the runner -- in this process or two gloo ranks; tiny preset."""

from __future__ import annotations

import pytest
import torch

from tests.serve.serve_tasks import serve_with_graphs
from wsharding.core.errors import InvalidArgument, Unsupported
from wsharding.linear import process_weights
from wsharding.models import ToyDecoder, decoder_config
from wsharding.serve import BlockPool, Request, Scheduler, serve
from wsharding.serve.runner import StepRunner, decode_shapes, shapes_of_every_rank, time_step
from wsharding.serve.step import build_step, context_buckets, padding_step, token_buckets


@pytest.fixture(scope="module")
def model() -> ToyDecoder:
    m = ToyDecoder(decoder_config("tiny")).eval()
    process_weights(m)
    return m


def _req(rid: int, prompt: int, output: int, vocab: int = 192) -> Request:
    g = torch.Generator().manual_seed(rid)
    return Request(rid, 0, 0.0, tuple(torch.randint(0, vocab, (prompt,), generator=g).tolist()), output)


def _decoding(model, prompts: list[int], budget: int = 256):
    """A pool and a scheduler whose prompts were prefilled in one step: its next step is decodes only."""
    pool = BlockPool.for_model(model, 24)
    s = Scheduler(pool, [_req(i, p, 6) for i, p in enumerate(prompts)], token_budget=budget)
    with torch.no_grad():
        first = s.schedule(0.0)
        built = build_step(pool, first, token_buckets(budget), context_buckets(256))
        s.step_done(first, model.forward_serve(built.step)[built.sample_rows].argmax(-1).tolist(), 0.0)
    return pool, s


def test_one_long_and_short_decodes_each_read_their_own_bucket(model):
    """One sequence of 100 tokens decodes beside four of 6..9: the four read 16 rows each (one group
    of 4), the long one 128 -- 4 * 16 + 1 * 128 = 192 rows per layer, where one width for the step
    read (4 + 1 -> 8 entries with the padding's) * 128 = 1024. Each row's logits are those of its
    sequence run alone in a step of its own bucket, bit for bit."""
    pool, s = _decoding(model, [100, 6, 7, 8, 9])
    step_of = s.schedule(0.0)
    assert [(x.start, x.count) for x in step_of] == [(100, 1), (6, 1), (7, 1), (8, 1), (9, 1)]
    sizes, widths = token_buckets(256), context_buckets(256)
    built = build_step(pool, step_of, sizes, widths)
    assert built.step.shape == (8, ((4, 1, 16), (1, 1, 128)))
    assert built.step.gathered_rows == 4 * 16 + 1 * 128
    assert built.step.decode_only
    with torch.no_grad():
        together = model.forward_serve(built.step)
        for i, x in enumerate(step_of):
            alone = build_step(pool, [x], sizes, widths)
            assert alone.step.shape == (1, ((1, 1, 128 if i == 0 else 16),))
            assert torch.equal(model.forward_serve(alone.step)[0], together[i]), i
        # a graph's static inputs hold every tensor the step reads: filled from the step, the same logits
        static = padding_step(pool, built.step.shape)
        static.copy_(built.step)
        assert torch.equal(model.forward_serve(static), together)


def test_chunks_read_their_own_bucket_and_decodes_stay_apart(model):
    """A mixed step: two decodes (16), a chunk of 3 at positions 40.. (64 wide) and one of 5 from 0
    (16): a decode group and two chunk groups, each at its own width."""
    pool, s = _decoding(model, [10, 12])
    extra = Scheduler(pool, [_req(7, 43, 2), _req(8, 5, 2)], token_budget=256)
    chunks = extra.schedule(0.0)
    from wsharding.serve.scheduler import Scheduled

    mixed = s.schedule(0.0) + [Scheduled(chunks[0].seq, 40, 3), chunks[1]]
    built = build_step(pool, mixed, token_buckets(256), context_buckets(256))
    assert built.step.shape == (16, ((2, 1, 16), (1, 8, 16), (1, 4, 64)))
    assert built.step.gathered_rows == 2 * 16 + 16 + 64 and not built.step.decode_only


def test_a_captured_shape_takes_only_a_step_of_its_shape(model):
    pool = BlockPool.for_model(model, 4)
    static = padding_step(pool, (4, ((4, 1, 32),)))
    assert static.shape == (4, ((4, 1, 32),)) and static.write.tolist() == [pool.scratch_block * 16] * 4
    assert static.gathered_rows == 128 and static.groups[0].read.max().item() < (pool.blocks + 1) * 16
    other = build_step(pool, [], [4], [16]).step
    with pytest.raises(InvalidArgument, match=r"a step of shape \(4, \(\(4, 1, 16\),\)\) cannot fill one of shape"):
        static.copy_(other)
    same = build_step(pool, [], [4], [32]).step
    static.copy_(same)
    assert all(torch.equal(a, b) for a, b in zip(static.tensors(), same.tensors(), strict=True))
    with pytest.raises(InvalidArgument, match="at least one group"):
        padding_step(pool, (4, ()))


def test_the_runner_is_eager_on_cpu_and_says_so(model):
    reqs = [_req(i, p, o) for i, (p, o) in enumerate([(9, 7), (30, 11), (12, 3)])]
    plain = serve(model, BlockPool.for_model(model, 8), reqs, token_budget=16, max_context=48)
    runner = StepRunner(model, BlockPool.for_model(model, 8))
    assert "CPU ranks" in runner.eager_reason and runner.capture(decode_shapes([1, 2], [16])) == 0
    with pytest.raises(InvalidArgument, match="has a prefill chunk group"):  # mixed steps are never captured
        runner.capture([(8, ((2, 1, 16), (1, 4, 16)))])
    run = serve(model, runner.pool, reqs, token_budget=16, max_context=48, runner=runner)
    assert run.outputs == plain.outputs
    assert runner.counts() == {"graphed_steps": 0, "eager_steps": run.steps, "graphs": 0, "capture_s": 0.0,
                               "eager_reason": runner.eager_reason}
    assert runner.missed and all(all(n == 1 for _, n, _ in groups) for _, groups in runner.missed)
    assert shapes_of_every_rank(list(runner.missed)) == sorted(runner.missed)
    assert decode_shapes([1, 2, 4], [16, 32], max_tokens=2) == [(1, ((1, 1, 16),)), (1, ((1, 1, 32),)),
                                                               (2, ((2, 1, 16),)), (2, ((2, 1, 32),))]


def test_time_step_eager_on_cpu_and_a_graph_refused(model):
    us = time_step(model, 4, 20, runs=3, warmup=1)
    assert isinstance(us, float) and us > 0
    with pytest.raises(Unsupported, match="no graph here: CUDA graphs need a GPU"):
        time_step(model, 4, 32, graph=True)
    with pytest.raises(InvalidArgument, match="tokens, width and runs >= 1"):
        time_step(model, 0, 32)


def test_sharded_serves_the_replicated_tokens_through_the_runner_on_cpu_ranks(cluster_of):
    """Two CPU ranks (gloo; emulated, not GPUs): the same pool size for both variants, so the same
    steps, so every token equal, graphs off and 'on' (eager on CPU, which the runner says)."""
    for r in cluster_of(2).run(serve_with_graphs, "tiny", requests=3, token_budget=16, prompt=(6, 40), output=(3, 8)):
        assert r["replicated_eager"] == r["sharded_eager"] == r["replicated_graphs"] == r["sharded_graphs"]
        assert sum(len(t) for t in r["sharded_eager"].values()) > 0
        for v in ("replicated", "sharded"):
            counts = r[f"{v}_graphs_counts"]
            assert counts["graphed_steps"] == 0 and "CPU ranks" in counts["eager_reason"]
            assert r[f"{v}_captured"] == 0 and counts["eager_steps"] == r[f"{v}_eager_counts"]["eager_steps"]
        assert r["shapes"] > 0


def test_graphs_are_refused_where_the_gathers_cannot_be_captured(model):
    """On a GPU, a sharded model over torch's communicator (several ranks) cannot capture its gathers:
    the reason, not a silent eager run. The replicated model (no gather) can; CPU ranks cannot."""
    from types import SimpleNamespace

    from wsharding.serve.runner import graph_refusal

    cuda = torch.device("cuda", 0)
    torch_comm = SimpleNamespace(device=cuda, world_size=2, captures_gathers=False, shared_gpu=False)
    sharded = SimpleNamespace(weight_sharding=SimpleNamespace(comm=torch_comm))
    assert graph_refusal(sharded, cuda) == "capturing gathers needs our NCCL communicator (--comm nccl)"
    assert graph_refusal(model, cuda) is None
    assert "CPU ranks" in graph_refusal(model, torch.device("cpu"))
    alone = SimpleNamespace(weight_sharding=SimpleNamespace(comm=SimpleNamespace(device=cuda, world_size=1)))
    assert graph_refusal(alone, cuda) is None
