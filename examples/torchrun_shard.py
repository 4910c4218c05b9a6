"""Weight sharding in a torchrun job.

    torchrun --nproc_per_node=2 examples/torchrun_shard.py            # GPUs with NCCL, else CPU/gloo
    torchrun --nproc_per_node=2 examples/torchrun_shard.py --out DIR  # also DIR/rank<r>.json per rank

Shard groups are one node each by default (``--group-size N`` to choose; a group wider than a node
warns: its gathers would cross the inter-node network at every layer). The process group is torn
down when the script exits (``init_from_env`` registers it), so the script needs no cleanup of its own.

Every rank builds the same model, shards its replicated linears over the group with the generic
path (blocks in an nn.ModuleList, nn.Linear targets), runs its own tokens through both the sharded
model and an untouched replica, and checks that the outputs are identical bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from wsharding.core.context import init_from_env
from wsharding.core.runner import shard_blocks
from wsharding.models import PRESETS, ToyDecoder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for one JSON report per rank (rank<r>.json)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="ranks per shard group (default: the ranks of one node)")
    args = parser.parse_args(argv)
    ctx = init_from_env()
    # `or` would take --group-size 0 as "not given": shard_comm refuses it (and a group the world cannot hold)
    comm = ctx.shard_comm(args.group_size)  # None: the ranks of one node
    cfg = PRESETS["tiny"]
    replica = ToyDecoder(cfg, seed=0, device=ctx.device).eval()
    model = ToyDecoder(cfg, seed=0, device=ctx.device).eval()
    # Shard it from the outside, as one would a Hugging Face style model: shard_blocks hooks each block.
    # (The ToyDecoder's layers also call the planner at their start; wait_ready_once has already run in
    # the block's hook by then and returns at once: a layer waits at most once per step.)
    ws = shard_blocks(model, "layers", ["attn.*_proj", "moe.latent_*", "moe.shared_expert.*"], comm,
                      sharded_layers=range(1, cfg.layers))
    tokens = torch.randint(0, cfg.vocab, (3 + 2 * ctx.rank,), generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        equal = torch.equal(replica(tokens.to(ctx.device)), model(tokens.to(ctx.device)))
    report = {"rank": ctx.rank, "world_size": ctx.world_size, "mode": ctx.mode, "emulation": ctx.emulation,
              "node": ctx.nodes[ctx.rank], "group_size": comm.world_size, "equal": equal, "gathers_per_step": ws.planner.gathers_this_step,
              "targets": sum(len(ts) for ts in ws.targets.values())}
    if args.out:
        # One file per rank: the ranks share one stdout, where their lines can interleave.
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f"rank{ctx.rank}.json.tmp"
        tmp.write_text(json.dumps(report))
        tmp.replace(out / f"rank{ctx.rank}.json")  # whole or absent, never half written
    print(f"rank {ctx.rank}: {json.dumps(report)}", flush=True)
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
