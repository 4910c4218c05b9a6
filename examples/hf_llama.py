"""A Hugging Face Llama, weight-sharded on N ranks, loaded row range by row range.

    python examples/hf_llama.py [--ranks 2] [--layers 8] [--dir /tmp/wsharding-llama]

A tiny ``LlamaForCausalLM`` (random init, no download; 8 layers) is saved with ``save_pretrained``. Every rank
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
from typing import Any

from wsharding.lab.cluster import RankCluster
from wsharding.lab.tasks.loading import hf_llama_sharded, save_llama


def resident_line(r: dict[str, Any], ranks: int) -> str:
    """Why a rank holds what it holds: its 1/N of the sharded weights plus the slots that a layer is
    gathered into, each as large as the largest layer. Against the replicated R that pays only when
    the layers outnumber 2N/(N-1) (the two slots cost two layers whole; the shards save (N-1)/N of
    all of them): a 2-layer model on 2 ranks holds 1.5 R."""
    shards = r["resident_bytes"] - r["slots"] * r["slot_bytes"]
    layers = len(r["sharded_layers"])
    need = 2 * ranks / (ranks - 1)
    verdict = (f"{r['resident_bytes'] / r['replicated_bytes']:.0%} of R" if r["resident_bytes"] < r["replicated_bytes"]
               else f"more than R: {layers} layers do not outnumber 2N/(N-1) = {need:g}, so the slots outweigh "
                    "the saving (--layers more)")
    return (f"resident per rank = R/N + {r['slots']} slots of the largest layer = {shards:,} + {r['slots']} x "
            f"{r['slot_bytes']:,} = {r['resident_bytes']:,} B against R = {r['replicated_bytes']:,} B replicated: "
            f"{verdict}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    p.add_argument("--layers", type=int, default=8,
                   help="decoder layers (default 8: with 2 layers the two slots outweigh the saving)")
    p.add_argument("--dir", default=None, help="where to save the model (default: a temporary folder)")
    args = p.parse_args()
    if args.ranks < 2:
        p.error(f"--ranks {args.ranks}: give 2 or more (one rank shares nothing, so it shows no saving)")
    if args.layers < 1:
        p.error(f"--layers {args.layers}: give 1 or more decoder layers")
    counts = [[3 + 2 * r for r in range(args.ranks)], [0] + [4] * (args.ranks - 1)]  # rank 0 idle in step 2
    with tempfile.TemporaryDirectory() as tmp, RankCluster(args.ranks, backend="gloo") as cluster:
        path = args.dir or f"{tmp}/llama"
        cluster.run(save_llama, path, num_hidden_layers=args.layers)
        results = cluster.run(hf_llama_sharded, path, counts)
    ok = True
    for r in results:
        c = r["counts"]
        print(f"rank {r['rank']} ({r['mode']}): logits equal per step {r['equal']}, gathers {r['gathers']}, "
              f"read {c['sharded_bytes_read']:,} B of sharded rows (of {r['replicated_bytes']:,} B), resident "
              f"{r['resident_bytes']:,} B")
        ok &= all(e in (True, None) for e in r["equal"])
    print(resident_line(results[0], args.ranks))
    if results[0]["emulation"]:
        print(f"NOTE: {results[0]['emulation']}")
    print("bit for bit equal to from_pretrained:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
