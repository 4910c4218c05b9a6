"""Where the sharded forward's extra host time goes, at decode sizes on one GPU (world size 1).

Times the replicated and the sharded llama8b-blocks forward in pairs (GPU drained before each call),
then profiles both with cProfile and prints the functions whose own time differs most. Run on the
GPU machine: PYTHONPATH=. python3 research/gpu_probes/host_overhead_profile.py [tokens] [--issue-thread]
Writes $OUT/host_overhead_profile.json when OUT is set.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

from wsharding.comm_by_name import shard_comm_for
from wsharding.core.runner import shard_blocks
from wsharding.lab.cluster import RankCluster
from wsharding.models.blocks import BLOCK_TARGETS, build_blocks


def own_times(prof: cProfile.Profile) -> dict[str, float]:
    st = pstats.Stats(prof)
    return {f"{os.path.basename(k[0])}:{k[1]}:{k[2]}": v[2] for k, v in st.stats.items()}  # tottime


def paired(a, b, calls: int, dev, layers: int):
    """Host time of ``a`` and ``b`` in pairs (order alternating, GPU drained before each timed call):
    (median b - a in us per layer, its quartiles, median ms of a, median ms of b). Each is a
    (setup, call) pair; setup runs untimed before its call."""
    diffs, ta, tb = [], [], []
    for k in range(calls):
        took = {}
        for name, (setup, call) in (((0, a), (1, b)) if k % 2 == 0 else ((1, b), (0, a))):
            setup()
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            call()
            took[name] = time.perf_counter() - t0
        diffs.append((took[1] - took[0]) * 1e6 / layers)
        ta.append(took[0] * 1e3)
        tb.append(took[1] * 1e3)
    torch.cuda.synchronize(dev)
    q1, med, q3 = statistics.quantiles(diffs, n=4)
    return (med, q1, q3), statistics.median(ta), statistics.median(tb)


def probe(ctx, tokens: int, issue_thread: bool, calls: int = 100, mapped: bool = False, ab: bool = True):
    c = shard_comm_for(ctx, "nccl")
    dev = c.device
    rep = build_blocks("llama8b-blocks", dev)
    sh = build_blocks("llama8b-blocks", dev)
    ws = shard_blocks(sh, "layers", BLOCK_TARGETS, c, map_own_chunk=mapped)
    if issue_thread:
        c.set_issue_thread(True)
    x = rep.inputs(tokens, 0, dev)
    out = {"tokens": tokens, "issue_thread": issue_thread, "layers": len(ws.sharded_layer_ids), "mapped": mapped}
    with torch.no_grad():
        assert torch.equal(rep(x), sh(x))
        for _ in range(5):
            rep(x), sh(x)
        nothing = lambda: None  # noqa: E731
        extra, hr, hs = paired((nothing, lambda: rep(x)), (nothing, lambda: sh(x)), calls, dev, out["layers"])
        out["host_ms"] = {"replicated": hr, "sharded": hs}
        out["extra_us_per_layer"] = extra[0]
        profs = {}
        for name, m in (("replicated", rep), ("sharded", sh)):
            p = cProfile.Profile()
            for _ in range(30):
                torch.cuda.synchronize(dev)
                p.enable()
                m(x)
                p.disable()
            torch.cuda.synchronize(dev)
            profs[name] = own_times(p)
        keys = set(profs["replicated"]) | set(profs["sharded"])
        delta = sorted(((profs["sharded"].get(k, 0) - profs["replicated"].get(k, 0)) / 30 / out["layers"] * 1e6, k)
                       for k in keys)
        out["top_extra_us_per_layer"] = [(round(d, 2), k) for d, k in reversed(delta[-25:])]
        out["top_less_us_per_layer"] = [(round(d, 2), k) for d, k in delta[:8]]
        out["total_profiled_us_per_layer"] = {n: sum(v.values()) / 30 / out["layers"] * 1e6 for n, v in profs.items()}
        # Inline against the issue thread, in pairs in this one process (the host drifts between runs).
        for spin_us in (50.0, 1000.0) if ab else ():
            os.environ["WSHARDING_ISSUE_SPIN_US"] = str(spin_us)
            def switched(on: bool):
                return lambda: (c.set_issue_thread(on), sh(x))  # one step to settle the switch

            diff, ti, tt = paired((switched(False), lambda: sh(x)), (switched(True), lambda: sh(x)), calls, dev,
                                  out["layers"])
            out[f"thread_minus_inline_us_per_layer_spin{int(spin_us)}"] = diff
            out[f"host_ms_spin{int(spin_us)}"] = {"inline": ti, "thread": tt}
        c.set_issue_thread(False)
        assert torch.equal(rep(x), sh(x))
    return out


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1
    it = "--issue-thread" in sys.argv
    from host_overhead_profile import probe as task  # importable by name in the spawned rank

    ranks = 2 if "--ranks2" in sys.argv else 1  # 2: both on the one GPU (NCCL >= 2.30), gathers with a peer
    with RankCluster(ranks, backend="gloo" if ranks > 1 else "nccl", task_timeout=600) as cl:
        rs = cl.run(task, tokens, it, mapped="--mapped" in sys.argv, ab="--no-ab" not in sys.argv)
    for r in rs:
        r.pop("top_less_us_per_layer")
    print(json.dumps(rs, indent=1))
    if os.environ.get("OUT"):
        name = (f"host_overhead_profile_{tokens}{'_it' if it else ''}{'_mapped' if '--mapped' in sys.argv else ''}"
                f"_{ranks}ranks.json")
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(rs, f, indent=1)
