"""A sharded model served by transformers' continuous batching on every rank of a shard group.

transformers' engine (``init_continuous_batching`` / ``ContinuousBatchingManager``, a paged KV cache,
the model run on the engine's own thread) serves each rank's own requests. A sharded model gathers
every sharded layer's weights in every forward, with every rank of its shard group; an engine steps
only when it has work, so ranks whose loads differ leave a peer waiting in a gather until the
collective timeout, and the engine then marks that rank's requests failed and returns what they had
as output. :class:`AlignedEngine` keeps the ranks in step:

[Note: one agreement per engine round]
Every round of every rank's engine -- a forward the engine runs (a generation step, a warm-up
forward) or a pass of its loop with nothing to run -- begins with one all-reduce of three integers
over the shard group (a gloo group of its own): how many ranks have work, how many would not yet
leave, and which ranks failed. A rank with work runs its forward; a rank without work runs the
package's one-token dummy step (:func:`~wsharding.core.runner.aligned_forward`) when any peer has
work, so that every rank issues the same gathers; when no rank has work nobody steps, and every rank
waits for new requests for at most ``idle_poll_s``; the ranks leave together, when none has work and
every one was asked to stop. The all-reduce sits in the engine's loop and in front of its
``compute_batch``, never inside the compiled forward.

[Note: a failed rank fails every rank]
A rank whose round raises (its forward, its scheduler, its dummy step) says so in one more
agreement and raises; its peers learn it in that same agreement and raise :class:`PeerFailed`. The
engine then marks every request of every rank failed, and this module turns a failed request into
an error (:class:`RequestFailed`): the engine's ``generate_batch`` logs the failure and returns the
truncated outputs as results, which :func:`generate` never does.

The engine's compiled path (``default_compile_level``) runs the sharded model as one graph per
forward but for the breaks the replicated model has too (the paged cache's update is not compiled)
and the step's start and end: [Note: the planner's calls as graph ops] in ``wsharding/core/graph_ops.py``.

The engine's internals this module reaches are checked when an :class:`AlignedEngine` is made
(:data:`ENGINE_INTERNALS`), so that another transformers version fails there, by name, instead of
somewhere in its loop. CUDA graphs and asynchronous batching of the engine are refused: a captured
forward would replay its gathers outside the planner, and an asynchronous one prepares the next batch
while the current one computes, which the agreement does not cover.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.errors import InvalidArgument, Unsupported, WshardingError
from wsharding.core.groups import shard_group_of
from wsharding.core.runner import aligned_forward


class EngineError(WshardingError, RuntimeError):
    """A request served by the engine did not complete."""


class PeerFailed(EngineError):
    """Another rank of the shard group failed in its engine round: this rank's requests fail with it."""


class RequestFailed(EngineError):
    """The engine marked a request failed (its tokens so far are not an output)."""


#: What of ``ContinuousBatchingManager`` and its batch processor this module uses.
ENGINE_INTERNALS = ("_generation_loop_body", "_generation_step", "_create_batch_processor", "_wake_up_loop",
                    "background_thread_status", "continuous_batching_config", "add_request", "get_result", "start",
                    "stop", "warmup", "is_running")


@dataclass
class RoundCounters:
    """What one rank's engine did, round by round ([Note: one agreement per engine round])."""

    #: Agreements made (one per round).
    rounds: int = 0
    #: Forwards of this rank's own requests (warm-up forwards included).
    steps: int = 0
    #: One-token dummy steps run because a peer had work and this rank had none.
    idle_steps: int = 0
    #: Rounds in which no rank had work (nobody stepped).
    quiet_rounds: int = 0
    #: Seconds spent in the agreements' all-reduce (host clock).
    agree_s: float = 0.0
    #: The most KV blocks the engine's cache held at once, read after each of this rank's own steps
    #: (the cache's blocks less its free capacity, as its scheduler counts it); None where the cache
    #: has no such count.
    kv_peak_blocks: int | None = None

    def as_dict(self) -> dict[str, Any]:
        per = self.agree_s / self.rounds * 1e6 if self.rounds else None
        return {"rounds": self.rounds, "steps": self.steps, "idle_steps": self.idle_steps,
                "quiet_rounds": self.quiet_rounds, "agree_s": self.agree_s, "agree_us_per_round": per,
                "kv_peak_blocks": self.kv_peak_blocks}


def kv_blocks_in_use(cache: Any) -> int | None:
    """Blocks of the engine's paged cache held by requests now: its blocks less its free capacity (free
    sectors and the free blocks of allocated ones, the count its scheduler admits by) in blocks of every
    allocator together. Read after a step's forward, before the engine's update frees the blocks of the
    requests it finished: the step's peak.
    None where this transformers' cache counts otherwise."""
    free_bytes = getattr(cache, "compute_free_capacity", None)
    allocators = getattr(cache, "cache_allocators", None)
    if free_bytes is None or not allocators:
        return None
    block = sum(ca.bytes_per_block for ca in allocators.values())
    return cache.num_blocks - round(free_bytes(relative=False) / block)


class StepAgreement:
    """The shard group's per-round agreement: one all-reduce (sum) of three int64 over a gloo group of
    the group's ranks, made once per communicator (:meth:`of`, collective the first time)."""

    _made: weakref.WeakKeyDictionary[Any, StepAgreement] = weakref.WeakKeyDictionary()

    def __init__(self, comm: Any) -> None:
        import torch.distributed as dist

        self.rank, self.size = comm.rank, comm.world_size
        self.group = None
        if self.size > 1:
            if not dist.is_initialized():
                raise EngineError("the engine's agreement needs torch.distributed: start the ranks with a RankCluster "
                                  "or torchrun (wsharding.init_from_env())")
            # the torch backend names its process group; ours (NCCL, the one that gathers where ranks share a
            # GPU) lists the group's ranks; neither: the standard group of consecutive ranks
            if comm.group is not None:
                ranks = dist.get_process_group_ranks(comm.group)
            elif comm.group_ranks:
                ranks = list(comm.group_ranks)
            else:
                ranks = shard_group_of(dist.get_rank(), dist.get_world_size(), self.size)
            timeout = comm.timeout
            kwargs = {"timeout": timeout} if timeout is not None else {}
            self.group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True, **kwargs)
        self.buffer = torch.zeros(3, dtype=torch.int64)
        self.counters = RoundCounters()

    @classmethod
    def of(cls, comm: Any) -> StepAgreement:
        """The agreement of ``comm``'s shard group, made at the first call (every rank of the group)."""
        try:
            made = cls._made.get(comm)
        except TypeError:  # a communicator that takes no weak reference: a new agreement every time
            return cls(comm)
        if made is None:
            made = cls._made[comm] = cls(comm)
        return made

    def reduce(self, work: bool, stay: bool, failed: bool) -> tuple[int, int, int]:
        """``(ranks with work, ranks that would not leave, bit mask of failed ranks)`` over the group."""
        if self.size == 1:
            return int(work), int(stay), (1 if failed else 0)
        import torch.distributed as dist

        b = self.buffer
        b[0], b[1], b[2] = int(work), int(stay), (1 << self.rank) if failed and self.rank < 62 else int(failed)
        t = time.perf_counter()
        dist.all_reduce(b, group=self.group)
        self.counters.agree_s += time.perf_counter() - t
        self.counters.rounds += 1
        w, s, f = b.tolist()
        return w, s, f

    def max_of(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the group (outside the rounds: every rank calls it)."""
        if self.size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()


def failed_ranks(mask: int) -> list[int]:
    """The ranks set in an agreement's failure mask."""
    return [r for r in range(62) if mask >> r & 1]


class AlignedEngine:
    """transformers' ``ContinuousBatchingManager`` over a sharded model, kept in step with the shard group.

    ``model``: the sharded ``PreTrainedModel`` (its sharding's hooks are on it: :func:`~wsharding.core.runner.shard_blocks`
    or :func:`~wsharding.checkpoint.load_sharded`); ``comm``: the sharding's communicator (``ws.comm``).
    Every rank of the group makes one, starts it and stops it; each adds its own requests. The
    engine's config (``cb_config``, a ``ContinuousBatchingConfig``) is the user's, with CUDA graphs and
    asynchronous batching off (refused when asked for). ``idle_poll_s``: how long an idle rank waits for
    a request before the next agreement (the latency a request arriving at an idle group may see).
    """

    def __init__(self, model: Any, comm: Any, *, generation_config: Any = None, cb_config: Any = None,
                 workload_hints: Any = None, idle_poll_s: float = 0.005) -> None:
        if not hasattr(model, "init_continuous_batching"):
            raise Unsupported(f"{type(model).__name__} has no init_continuous_batching: the engine is transformers' "
                              "continuous batching (transformers >= 5 with the hf extra: pip install 'wsharding[hf]')")
        if not idle_poll_s > 0:
            raise InvalidArgument(f"idle_poll_s: need seconds > 0, got {idle_poll_s}")
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cfg = ContinuousBatchingConfig() if cb_config is None else copy.deepcopy(cb_config)
        if cfg.use_cuda_graph is None:
            cfg.use_cuda_graph = False
        if cfg.use_async_batching is None:
            cfg.use_async_batching = False
        self.model, self.comm, self.idle_poll_s = model, comm, idle_poll_s
        self.agreement = StepAgreement.of(comm)
        self.counters = self.agreement.counters = RoundCounters()
        self.failure: BaseException | None = None
        #: Per request id: how often the engine evicted it (offloaded or reset) to make room.
        self.preemptions: dict[str, int] = {}
        self.manager = model.init_continuous_batching(generation_config=generation_config,
                                                      continuous_batching_config=cfg, workload_hints=workload_hints)
        missing = [a for a in ENGINE_INTERNALS if not hasattr(self.manager, a)]
        if missing:
            raise Unsupported(f"this transformers' ContinuousBatchingManager has no {', '.join(missing)}: the aligned "
                              "engine knows transformers 5.2x; use a version of that series")
        resolved = self.manager.continuous_batching_config
        if any(resolved.cuda_graph_booleans):
            raise Unsupported(f"rank {comm.rank}: CUDA graphs of the engine (use_cuda_graph={resolved.use_cuda_graph}) "
                              "on a sharded model: a captured forward replays its gathers outside the planner; pass "
                              "ContinuousBatchingConfig(use_cuda_graph=False)")
        if resolved.use_async_batching:
            raise Unsupported(f"rank {comm.rank}: asynchronous batching of the engine on a sharded model: it prepares "
                              "the next batch while one computes, outside the ranks' agreement; pass "
                              "ContinuousBatchingConfig(use_async_batching=False)")
        self._wrap_manager()
        self._started = False

    # ---- the engine's loop, wrapped ------------------------------------------------------------------
    def _wrap_manager(self) -> None:
        m = self.manager
        create = m._create_batch_processor

        def create_wrapped() -> Any:
            bp = create()
            self._wrap_processor(bp)
            return bp

        m._create_batch_processor = create_wrapped
        m._generation_loop_body = self._loop_body

    def _wrap_processor(self, bp: Any) -> None:
        runner = bp.model_runner
        if getattr(runner, "_wsharding_wrapped", False):
            return
        compute = runner.compute_batch

        def compute_aligned(model: Any, batch_data: dict) -> None:
            self._round(work=True, stay=True)
            try:
                compute(model, batch_data)
            except BaseException as e:
                self._announce(e)
                raise
            self.counters.steps += 1
            used = kv_blocks_in_use(bp.cache)
            if used is not None and (self.counters.kv_peak_blocks is None or used > self.counters.kv_peak_blocks):
                self.counters.kv_peak_blocks = used

        runner.compute_batch = compute_aligned
        runner._wsharding_wrapped = True
        off = bp.offloading_manager
        offload, add = off.offload_requests, bp.scheduler.add_waiting_request
        evicting = threading.local()

        def offload_counted() -> bool:
            evicting.on = True
            try:
                return offload()
            finally:
                evicting.on = False

        def add_counted(state: Any) -> None:
            if getattr(evicting, "on", False):
                self.preemptions[state.request_id] = self.preemptions.get(state.request_id, 0) + 1
            add(state)

        off.offload_requests = offload_counted
        bp.scheduler.add_waiting_request = add_counted

    def _round(self, work: bool, stay: bool) -> tuple[int, int]:
        """One agreement ([Note: one agreement per engine round]); raises if a rank failed."""
        if self.failure is not None:
            raise PeerFailed(f"rank {self.comm.rank}: the shard group's engine already failed ({self.failure}); "
                             "make a new AlignedEngine on every rank") from self.failure
        w, s, f = self.agreement.reduce(work, stay, False)
        if f:
            ranks = failed_ranks(f) or ["?"]
            self.failure = PeerFailed(
                f"rank {self.comm.rank}: rank(s) {', '.join(map(str, ranks))} of the shard group failed in their "
                "engine round (their own error says why), so no rank can run another forward of the sharded model; "
                "every request of every rank is failed")
            raise self.failure
        return w, s

    def _announce(self, err: BaseException) -> None:
        """[Note: a failed rank fails every rank]: this rank's round raised; tell the peers once."""
        if self.failure is not None:
            return
        self.failure = err
        try:
            self.agreement.reduce(False, False, True)
        except Exception:  # noqa: BLE001 - the peers may be gone; the error on its way says why
            pass

    def _loop_body(self, bp: Any, bootstrapping: bool) -> bool:
        """The engine's loop body, in step with the group (the engine calls it until it returns False)."""
        m = self.manager
        try:
            if bp.prepare_next_batch():
                m._generation_step()  # its compute_batch makes the round's agreement
                m.current_batch += 1
                if bootstrapping:
                    return False
                bp.update_batch()
                return True
            status = m.background_thread_status
            leaving = status.local_status >= status.HARD_STOP or (
                status.local_status == status.FLUSH_AND_STOP and not bp.has_pending_requests())
            work, stay = self._round(work=False, stay=not leaving)
            if work:
                self.dummy_step()
                return True
            if not stay:
                return False
            self.counters.quiet_rounds += 1
            m._wake_up_loop.wait(self.idle_poll_s)
            m._wake_up_loop.clear()
            return True
        except BaseException as e:
            self._announce(e)
            raise

    def dummy_step(self) -> None:
        """The package's one-token dummy step (no KV cache touched): every sharded layer gathered, as a peer's
        forward gathers them."""
        device = self.model.device

        def forward(ids: torch.Tensor) -> Any:
            with torch.no_grad():
                return self.model(input_ids=ids, use_cache=False, logits_to_keep=1)

        aligned_forward(forward, None, lambda: torch.zeros(1, 1, dtype=torch.long, device=device))
        self.counters.idle_steps += 1

    # ---- what a user calls -------------------------------------------------------------------------------
    def start(self) -> AlignedEngine:
        """Warm the engine up (its compiled paths: every warm-up forward is a round) and start its thread."""
        if self._started:
            raise EngineError(f"rank {self.comm.rank}: this engine was started already")
        self._started = True
        self.manager.warmup()
        self.raise_if_failed()
        self.manager.start()
        return self

    def raise_if_failed(self) -> None:
        """Raise the group's failure, if there was one ([Note: a failed rank fails every rank])."""
        err = self.failure or self.manager.background_thread_status.fatal_error
        if err is not None:
            if isinstance(err, EngineError):
                raise err
            raise EngineError(f"rank {self.comm.rank}: the engine failed: {type(err).__name__}: {err}") from err

    def add_request(self, input_ids: Sequence[int], *, max_new_tokens: int | None = None, request_id: str | None = None,
                    record_timestamps: bool = False) -> str:
        """Queue one request on this rank's engine; its id."""
        self.raise_if_failed()
        rid = self.manager.add_request(list(input_ids), request_id=request_id, max_new_tokens=max_new_tokens,
                                       record_timestamps=record_timestamps)
        if rid is None:
            self.raise_if_failed()
            raise EngineError(f"rank {self.comm.rank}: the engine refused the request (it is stopping or not started)")
        return rid

    def results(self, request_ids: Iterable[str], *, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until every one of ``request_ids`` finished; their ``GenerationOutput`` by id, in that order.
        A failed request raises :class:`RequestFailed` (the group's failure, when there was one)."""
        wanted = list(request_ids)
        done: dict[str, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(done) < len(wanted):
            out = self.manager.get_result(timeout=0.05)
            if out is not None:
                if out.error is not None:
                    self._fail_request(out)
                if out.is_finished():
                    done[out.request_id] = out
                continue
            if not self.manager.is_running():
                self.raise_if_failed()
                missing = [r for r in wanted if r not in done]
                raise EngineError(f"rank {self.comm.rank}: the engine stopped before requests {missing[:5]} finished")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineError(f"rank {self.comm.rank}: requests not finished after {timeout_s} s")
        return {r: done[r] for r in wanted}

    def _fail_request(self, out: Any) -> None:
        cause = self.failure or self.manager.background_thread_status.fatal_error
        raise RequestFailed(f"rank {self.comm.rank}: request {out.request_id} failed after "
                            f"{len(out.generated_tokens)} token(s), which are not an output: {out.error}") from cause

    def stop(self) -> None:
        """Stop this rank's engine once every rank of the group stopped (they leave together); raise the group's
        failure, if there was one."""
        if self.manager.is_running():
            self.manager.stop(block=True)
        self.raise_if_failed()

    def __enter__(self) -> AlignedEngine:
        return self.start() if not self._started else self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.stop()
        elif self.manager.is_running():
            self.manager.stop(block=True)


def generate(model: Any, comm: Any, inputs: Sequence[Sequence[int]], *, max_new_tokens: int,
             generation_config: Any = None, cb_config: Any = None, record_timestamps: bool = False,
             idle_poll_s: float = 0.005) -> tuple[dict[str, Any], AlignedEngine]:
    """``generate_batch`` for a sharded model: every rank of the group calls it with its own prompts
    (none is fine). Returns this rank's outputs (``GenerationOutput`` by request id, in input order) and
    the engine (its :class:`RoundCounters` say how many dummy steps this rank ran); raises
    :class:`RequestFailed` / :class:`PeerFailed` instead of returning a truncated output.

    The workload hints the engine sizes itself by (longest prompt, output length, requests) are the
    group's maximum, so that every rank's engine is configured alike."""
    agreement = StepAgreement.of(comm)
    longest = max((len(p) for p in inputs), default=0)
    hints_max = agreement.max_of([longest, max_new_tokens, len(inputs)])
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=hints_max[0], max_generated_length=hints_max[1],
                          num_requests=max(hints_max[2], 1))
    engine = AlignedEngine(model, comm, generation_config=generation_config, cb_config=cb_config,
                           workload_hints=hints, idle_poll_s=idle_poll_s)
    with engine:
        ids = [engine.add_request(p, max_new_tokens=max_new_tokens, record_timestamps=record_timestamps)
               for p in inputs]
        outputs = engine.results(ids)
    return outputs, engine
