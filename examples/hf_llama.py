"""A Hugging Face Llama, weight-sharded on N ranks, loaded row range by row range.

    python examples/hf_llama.py [--ranks 2] [--dir /tmp/wsharding-llama]

A tiny ``LlamaForCausalLM`` (random init, no download) is saved with ``save_pretrained``. Every rank
then has ``wsharding.checkpoint.load_sharded`` build the model with every parameter on meta and
shard its attention and MLP projections over the group: no weight is ever whole on a rank, each
rank reads only its rows of every projection from the file, and
finalize redistributes them into flat chunks. The logits are compared bit for bit with the model
Hugging Face's own ``from_pretrained`` loads, with a different prompt on every rank and one rank idle
(it runs a one-token dummy step, so that every rank issues the same gathers).

What a user writes beyond ``shard_blocks`` is one call::

    ws = load_sharded(lambda: LlamaForCausalLM(config), checkpoint_dir, "model.layers", HF_LLAMA_PATTERNS, comm)
    model = ws.model

The rank work is :func:`wsharding.lab.tasks.loading.hf_llama_sharded` (spawned ranks import tasks
from the package by name). Without GPUs the ranks are CPU processes (gloo) -- the output says so.
"""

from __future__ import annotations

import argparse
import tempfile

from wsharding.cluster import RankCluster
from wsharding.lab.tasks.loading import hf_llama_sharded, save_llama


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to save the model (default: a temporary folder)")
    args = p.parse_args()
    counts = [[3 + 2 * r for r in range(args.ranks)], [0] + [4] * (args.ranks - 1)]  # rank 0 idle in step 2
    with tempfile.TemporaryDirectory() as tmp, RankCluster(args.ranks, backend="gloo") as cluster:
        path = args.dir or f"{tmp}/llama"
        cluster.run(save_llama, path)
        results = cluster.run(hf_llama_sharded, path, counts)
    ok = True
    for r in results:
        c = r["counts"]
        print(f"rank {r['rank']} ({r['mode']}): logits equal per step {r['equal']}, gathers {r['gathers']}, "
              f"read {c['sharded_bytes_read']} B of sharded rows (of {r['replicated_bytes']} B), resident "
              f"{r['resident_bytes']} B")
        ok &= all(e in (True, None) for e in r["equal"])
    if results[0]["emulation"]:
        print(f"NOTE: {results[0]['emulation']}")
    print("bit for bit equal to from_pretrained:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
