"""``wsharding demo``: the main job.

First form (issue #2): build the flat layout of a mixed-dtype layer, gather it on N rank processes
and check every byte. Later stages extend it to a whole model sharded against its replicated twin.
"""

from __future__ import annotations

import argparse
import json

import torch

from wsharding.cluster import RankCluster
from wsharding.layout import FlatLayout
from wsharding.ranks_tasks import gather_layout

#: A layer with weights of several dtypes whose sizes make chunks cross weight borders.
DEMO_LAYER = [
    ("attn.qkv_proj", (96, 64), torch.bfloat16),
    ("attn.o_proj", (64, 64), torch.bfloat16),
    ("moe.router", (8, 64), torch.float32),
    ("moe.latent_down", (33, 64), torch.float8_e4m3fn),
    ("moe.latent_up", (64, 33), torch.float16),
    ("moe.shared_expert", (5, 7), torch.int8),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=None, help="number of ranks (default: all GPUs, or 4 CPU ranks)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--report", default=None, help="write a JSON report to this path")


def default_ranks() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 4


def main(args: argparse.Namespace) -> int:
    n = args.ranks or default_ranks()
    layout = FlatLayout(DEMO_LAYER, n)
    print(layout.table())
    with RankCluster(n, backend=args.backend) as cluster:
        reports = cluster.run(gather_layout, layout)
    print(f"\nmode: {cluster.mode}" + (f" ({cluster.emulation})" if cluster.emulation else ""))
    for r in reports:
        print(f"  rank {r['rank']}: gathered {r['bytes']} B, mismatched bytes {r['mismatched_bytes']}, "
              f"views equal {r['views_equal']}, {r['seconds'] * 1e3:.2f} ms")
    ok = all(r["mismatched_bytes"] == 0 and r["views_equal"] for r in reports)
    print("byte-exact: " + ("yes" if ok else "NO"))
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"mode": cluster.mode, "emulation": cluster.emulation, "world_size": n,
                       "total_bytes": layout.total_bytes, "ranks": reports, "byte_exact": ok}, f, indent=2)
    return 0 if ok else 1
