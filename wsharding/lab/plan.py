"""``wsharding plan``: the memory and traffic bill of weight sharding, before any GPU runs.

    wsharding plan                      # the design's own deployment: DEFAULT_PRESET, said on the first line
    wsharding plan --preset kimi-k3-b200-fp8 [--ranks N] [--bandwidth GBps] [--tokens T] [--json [PATH]]
    wsharding plan --model my_model.yaml --device h200 --ranks 4
    wsharding plan --list

A readable table by default (GiB = 2**30 B and GB = 10**9 B are both named); ``--json`` prints one
object whose byte counts are integers instead (see :meth:`wsharding.costmodel.Plan.to_dict`), and
``--json PATH`` writes it to PATH beside the table.
"""

from __future__ import annotations

import argparse
import sys

from wsharding.costmodel import (
    GB,
    CostModelError,
    Deployment,
    Plan,
    estimate,
    get_device,
    load_model_file,
    plan_table,
)
from wsharding.lab.cliargs import (
    InputError,
    OneLineParser,
    add_json_option,
    check_output_path,
    checked_number,
    emit_json,
)
from wsharding.presets import list_presets, load_preset

#: The deployment the weight-sharding design starts from (Kimi K3 decode DP16 on B200, FP8: 48.8 GiB of
#: KDA, MLA and MoE-peripheral weights replicated on every GPU): what ``wsharding plan`` prices when
#: given neither ``--preset`` nor ``--model``.
DEFAULT_PRESET = "kimi-k3-b200-fp8"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help=f"a shipped model preset (see --list; default {DEFAULT_PRESET}, the "
                                      "deployment the weight-sharding design starts from)")
    src.add_argument("--model", metavar="FILE", help="a model description in JSON or YAML (format: costmodel.model_from_dict)")
    src.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("--ranks", type=int, default=None, help="shard group size N (default: the preset's)")
    p.add_argument("--bandwidth", type=float, default=None, metavar="GBps",
                   help="link bandwidth per direction in GB/s (10**9 B/s; default: the device's NVLink figure)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (default: the preset's, else 256)")
    p.add_argument("--device", default=None, help="device peaks: b200 or h200 (default: the preset's, else b200)")
    p.add_argument("--efficiency", type=float, default=1.0, help="fraction of peak FLOP/s the GEMMs reach (default 1)")
    p.add_argument("--latency-us", type=checked_number(float, 0), default=0.0,
                   help="fixed cost of one gather in microseconds (default 0)")
    p.add_argument("--dtype", default=None, help="re-price the same weights in another dtype (bf16, fp8_e4m3, ...)")
    p.add_argument("--kv-bytes-per-token", type=int, default=None, help="KV cache bytes per token (default: the preset's)")
    p.add_argument("--context", type=int, default=None, help="tokens per request, to count extra concurrent requests")
    p.add_argument("--map-own-chunk", action="store_true",
                   help="price WeightSharding(map_own_chunk=True): chunks in 2 MiB pages, slots (N-1)/N after finalize")
    p.add_argument("--kv-pool-gib", type=checked_number(float, 0), default=None,
                   help="KV-cache pool per GPU with replicated weights, GiB (default: the preset's assumption)")
    add_json_option(p, "the plan")


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Build the :class:`~wsharding.costmodel.Plan` the arguments ask for (raises CostModelError)."""
    if args.model:
        model = load_model_file(args.model)
    else:
        model = load_preset(args.preset or DEFAULT_PRESET)
    if args.dtype:
        model = model.with_dtype(args.dtype)
    d = model.defaults
    deployment = Deployment(
        ranks=args.ranks if args.ranks is not None else d.get("ranks", 8),
        device=get_device(args.device or d.get("device", "b200")),
        tokens=args.tokens if args.tokens is not None else d.get("tokens", 256),
        link_bandwidth=None if args.bandwidth is None else args.bandwidth * GB,
        efficiency=args.efficiency,
        collective_latency=args.latency_us * 1e-6,
        kv_bytes_per_token=args.kv_bytes_per_token,
        context=args.context if args.context is not None else d.get("context"),
        kv_pool_bytes=None if getattr(args, "kv_pool_gib", None) is None else int(args.kv_pool_gib * 2**30),
        map_own_chunk=getattr(args, "map_own_chunk", False),
    )
    return estimate(model, deployment)


def main(args: argparse.Namespace) -> int:
    if args.list:
        for name in list_presets():
            print(f"{name:<32} {load_preset(name).description}")
        return 0
    if not (args.preset or args.model):
        # said first, and beside the JSON on stderr, so that stdout stays one JSON object
        print(f"wsharding plan: no --preset or --model given: pricing {DEFAULT_PRESET}, the deployment the "
              "weight-sharding design starts from (--preset NAME or --model FILE for another; --list shows the "
              "presets)",
              file=sys.stderr if args.json == "-" else sys.stdout)
    try:
        check_output_path(args.json or "", "--json")
        plan = plan_from_args(args)
    except (CostModelError, InputError) as e:
        print(f"wsharding plan: error: {e}", file=sys.stderr)
        return 2
    if args.json != "-":
        print(plan_table(plan))
    written = emit_json(plan.to_dict(), args.json)
    if written:
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    parser = OneLineParser(prog="python -m wsharding.lab.plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
