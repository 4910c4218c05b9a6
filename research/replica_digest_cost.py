"""What ``verify_replicas`` costs: the sharded k3-like ToyDecoder (12 layers, 11 sharded) built on a
RankCluster of 2 gloo ranks with the check on; prints, per rank, the time spent digesting the targets
at setup (and their bytes), the whole build, and finalize's agreement (the record that carries the
digests). Only the sharded model is built (about 6 GiB per rank), not its replicated twin.

Run from the repository root: ``PYTHONPATH=. .venv/bin/python research/replica_digest_cost.py [preset]``."""

from __future__ import annotations

import sys
import time

import torch

import wsharding.core.sharding as sharding
from wsharding.core.replicas import weight_digest


def digest_cost(ctx, preset: str) -> dict[str, float]:
    from wsharding.comm_by_name import shard_comm_for
    from wsharding.models import ToyDecoder, decoder_config

    spent = {"digest_s": 0.0, "digest_bytes": 0, "agree_s": 0.0, "weights": 0}

    def timed_digest(w: torch.Tensor) -> int:
        t0 = time.perf_counter()
        d = weight_digest(w)
        spent["digest_s"] += time.perf_counter() - t0
        spent["digest_bytes"] += w.numel() * w.element_size()
        spent["weights"] += 1
        return d

    agree = sharding.agree_or_raise

    def timed_agree(*args, **kwargs) -> None:
        t0 = time.perf_counter()
        agree(*args, **kwargs)
        spent["agree_s"] += time.perf_counter() - t0

    sharding.weight_digest, sharding.agree_or_raise = timed_digest, timed_agree
    cfg = decoder_config(preset)
    comm = shard_comm_for(ctx, "torch")
    t0 = time.perf_counter()
    ws = sharding.WeightSharding(comm, sharded_layers=range(1, cfg.layers))
    ToyDecoder(cfg, seed=0, weight_sharding=ws, device=comm.device)
    spent["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ws.finalize()
    spent["finalize_s"] = time.perf_counter() - t0
    ws.close()
    return spent


if __name__ == "__main__":
    preset = sys.argv[1] if len(sys.argv) > 1 else "k3-like"
    from research.replica_digest_cost import digest_cost as task  # ranks import a task by its module's name
    from wsharding.lab.cluster import RankCluster

    with RankCluster(2, backend="gloo", task_timeout=1800, collective_timeout=600) as cluster:
        for rank, r in enumerate(cluster.run(task, preset)):
            print(f"rank {rank}: {r['weights']} targets, {r['digest_bytes'] / 1e9:.2f} GB digested in "
                  f"{r['digest_s']:.2f} s ({r['digest_bytes'] / r['digest_s'] / 1e9:.2f} GB/s, one thread), "
                  f"{100 * r['digest_s'] / r['build_s']:.1f} % of the build ({r['build_s']:.1f} s); "
                  f"finalize {r['finalize_s']:.2f} s, of which the agreement {r['agree_s'] * 1e3:.1f} ms", flush=True)
