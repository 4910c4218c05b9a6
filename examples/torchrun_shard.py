"""Weight sharding in a torchrun job.

    torchrun --nproc_per_node=2 examples/torchrun_shard.py            # GPUs with NCCL, else CPU/gloo

Every rank builds the same model, shards its replicated linears over the group with the generic
path (blocks in an nn.ModuleList, nn.Linear targets), runs its own tokens through both the sharded
model and an untouched replica, and checks that the outputs are identical bit for bit.
"""

from __future__ import annotations

import json
import sys

import torch

from wsharding.cluster import init_from_env
from wsharding.models import PRESETS, ToyDecoder
from wsharding.shard import shard_blocks


def main() -> int:
    ctx = init_from_env()
    cfg = PRESETS["tiny"]
    replica = ToyDecoder(cfg, seed=0, device=ctx.device).eval()
    model = ToyDecoder(cfg, seed=0, device=ctx.device).eval()
    # Shard it from the outside, as one would a Hugging Face style model: shard_blocks hooks each block.
    # (The ToyDecoder's layers also call the planner at their start; wait_ready_once has already run in
    # the block's hook by then and returns at once: a layer waits at most once per step.)
    ws = shard_blocks(model, "layers", ["attn.*_proj", "moe.latent_*", "moe.shared_expert.*"], ctx.shard_comm(8),
                      sharded_layers=range(1, cfg.layers))
    tokens = torch.randint(0, cfg.vocab, (3 + 2 * ctx.rank,), generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        equal = torch.equal(replica(tokens.to(ctx.device)), model(tokens.to(ctx.device)))
    print(json.dumps({"rank": ctx.rank, "world_size": ctx.world_size, "mode": ctx.mode, "emulation": ctx.emulation,
                      "equal": equal, "gathers_per_step": ws.planner.gathers_this_step,
                      "targets": sum(len(ts) for ts in ws.targets.values())}))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
