"""A weight-sharded Llama served by transformers' continuous batching on N ranks whose loads differ.

    python examples/serve_transformers.py [--ranks 2] [--requests 6] [--rate 20] [--layers 2] [--compile 0]

Every rank runs transformers' own engine (``ContinuousBatchingManager``: a paged KV cache, the model
run on the engine's thread) over its own requests, arriving over time through ``add_request``. The
Llama's attention and MLP projections are sharded over the ranks, so every forward gathers each
layer's weights with every rank: :class:`wsharding.engines.transformers_cb.AlignedEngine` keeps the
engines in step (one small all-reduce per engine round; a rank with nothing to run while a peer
steps runs a one-token dummy step). The same requests are then served by the replicated model, and
the script prints whether every request's tokens are equal, what each rank's engine did, and the
serving metrics of both runs (the fields of the package's own ``bench serve``).

What a user writes, on every rank of the shard group::

    ws = shard_blocks(model, "model.layers", patterns, comm)          # or load_sharded(...)
    with AlignedEngine(model, ws.comm, generation_config=gen, cb_config=cb) as engine:
        ids = [engine.add_request(prompt, max_new_tokens=n) for prompt in my_prompts]
        outputs = engine.results(ids)     # raises if any rank failed; never a truncated output

or, for a batch: ``outputs, engine = generate(model, ws.comm, my_prompts, max_new_tokens=n, ...)``.

Without GPUs the ranks are CPU processes (gloo) and every time is emulated -- the output says so; with
enough GPUs, one rank per GPU with NCCL. The rank work is
:func:`wsharding.lab.tasks.engine.engine_serve` (spawned ranks import tasks from the package by name).
"""

from __future__ import annotations

import argparse
import math

from wsharding.lab.cluster import RankCluster
from wsharding.lab.tasks.engine import run_engine_trial
from wsharding.serve.metrics import SLO
from wsharding.serve.workload import Workload


def main(argv: list[str] | None = None, cluster: RankCluster | None = None) -> int:
    """Parse ``argv``, serve on ``cluster`` (None: start one of ``--ranks`` processes), print; 0 when every
    token is equal."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    p.add_argument("--requests", type=int, default=6, help="requests per rank (default 6)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second per rank (default 20; inf: all at once)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny Llama (default 2)")
    p.add_argument("--compile", type=int, default=0, choices=(0, 1, 2, 3),
                   help="the engine's default_compile_level (default 0: eager)")
    p.add_argument("--slo", default="ttft=2000,tpot=500", help="SLOs for goodput (default ttft=2000,tpot=500 ms)")
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error(f"--ranks {args.ranks}: give 2 or more (one rank shares nothing)")
    if args.requests < 1 or args.layers < 1:
        p.error("--requests and --layers: give 1 or more")
    rate = math.inf if args.rate == math.inf else args.rate
    workload = Workload(requests=args.requests, prompt=(4, 12), output=(2, 12), rate=rate, seed=0)
    slo = SLO.parse(args.slo)
    if cluster is None:
        with RankCluster(args.ranks, task_timeout=600) as own:
            trial = run_engine_trial(own, workload, slo, layers=args.layers, compile_level=args.compile)
    else:
        trial = run_engine_trial(cluster, workload, slo, layers=args.layers, compile_level=args.compile)
    print(f"workload: {trial['workload']}")
    for rank, c in enumerate(trial["counters"]):
        print(f"rank {rank}: {c['rounds']} rounds, {c['steps']} forwards of its own, {c['idle_steps']} dummy steps "
              f"while a peer worked, {c['quiet_rounds']} rounds with no work anywhere; agreement "
              f"{c['agree_us_per_round']:.0f} us per round (waiting for the peers included)")
    for variant in ("sharded", "replicated"):
        m = trial[variant]["metrics"]
        print(f"{variant:>10}: KV pool {trial[variant]['num_blocks']} blocks of {trial[variant]['page_size']} tokens "
              f"per rank; TTFT p50 {m['ttft_ms']['p50']:.1f} ms, TPOT p50 "
              f"{(m['tpot_ms']['p50'] or 0):.1f} ms, {m['output_throughput']:.1f} output tokens/s per rank, "
              f"goodput {m['goodput']:.2f} requests/s per rank ({slo.describe()})")
    if trial["emulation"]:
        print(f"NOTE: {trial['emulation']}")
    print("every request's tokens equal to the replicated engine's:", "yes" if trial["tokens_equal"] else "NO")
    return 0 if trial["tokens_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
