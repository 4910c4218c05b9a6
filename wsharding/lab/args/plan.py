"""The options of ``wsharding plan`` (:mod:`wsharding.lab.plan` runs it) and the checks that need only them."""

from __future__ import annotations

import argparse

from wsharding.lab.cliargs import (
    InputError,
    add_json_option,
    checked_number,
    int_at_least,
    length_range,
    number_list,
    slo_arg,
)

#: The deployment the weight-sharding design starts from (Kimi K3 decode DP16 on B200, FP8: 48.8 GiB of
#: KDA, MLA and MoE-peripheral weights replicated on every GPU): what ``wsharding plan`` prices when
#: given neither ``--preset`` nor ``--model``.
DEFAULT_PRESET = "kimi-k3-b200-fp8"
#: ``--link``: the profile's own steps, the profile's gathers in series, or a datasheet's NVLink with lookahead.
LINKS = ("measured", "time-sliced", "h200", "b200")


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
    add_serve_arguments(p)


def _profile_arg(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("an empty path: give a profile or bench serve JSON, or 'measure'")
    return text


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan --serve (PREDICTED: the package's scheduler replayed against a step-time profile)")
    g.add_argument("--serve", action="store_true",
                   help="predict each variant's sustained request rate per budget instead of the bill")
    g.add_argument("--profile", type=_profile_arg, default=None, metavar="FILE|measure",
                   help="step times: a profile JSON or a prediction's (--json of a --profile measure run), a bench serve "
                        "--json report, "
                        "or 'measure' (time them now on rank processes)")
    g.add_argument("--decoder", default=None, help="--profile measure: the decoder preset (default tiny-deep on CPU, "
                                                   "k3-like on GPUs)")
    g.add_argument("--profile-ranks", type=int_at_least(2), default=2, help="--profile measure: ranks (default 2)")
    g.add_argument("--link", choices=LINKS, default=None,
                   help="gathers: measured (each variant's steps as the profile measured them; default), time-sliced "
                        "(the profile's gathers in series with compute), h200 / b200 (their NVLink, or --bandwidth, "
                        "with lookahead, for --ranks GPUs)")
    g.add_argument("--compute-scale", type=checked_number(float, 0.0), default=None, metavar="F",
                   help="with --link time-sliced/h200/b200: the profile's compute times F, for a GPU not at hand "
                        "(e.g. the ratio of two datasheet peaks; default 1)")
    g.add_argument("--kv-share", type=number_list(float, 0.0, "fraction", "0.05,0.3", below=1.0), default=None,
                   help="budgets in which the replicated KV pool is this share (default 0.05,0.3)")
    g.add_argument("--rate", type=number_list(float, 0.0, "requests/s", "1,4"), default=None,
                   help="rates per rank to replay first (default 1); the search widens and bisects from them")
    g.add_argument("--no-search", action="store_true", help="replay only the rates given")
    g.add_argument("--prompt", type=length_range, default=None,
                   help="prompt lengths LOW:HIGH (default 8:24 for a CPU profile, 64:512 for a GPU's)")
    g.add_argument("--output", type=length_range, default=None,
                   help="output lengths LOW:HIGH (default 4:16 for a CPU profile, 64:256 for a GPU's)")
    g.add_argument("--requests", type=int_at_least(1), default=None,
                   help="requests per rank (default 60 for a CPU profile, 200 for a GPU's)")
    g.add_argument("--trials", type=int_at_least(1), default=1, help="replays per rate, other seeds (default 1)")
    g.add_argument("--warmup", type=int_at_least(0), default=None, help="requests per rank left out (default a tenth)")
    g.add_argument("--token-budget", type=int_at_least(1), default=None,
                   help="tokens per step (default the profile's; measured: 64 on CPU, 512 on GPUs)")
    g.add_argument("--slo", type=slo_arg, default=None,
                   help="ttft=MS,tpot=MS[,e2e=MS][,attainment=F] (default ttft=3000,tpot=300 for a CPU profile, "
                        "ttft=2000,tpot=200 else)")
    g.add_argument("--seed", type=int, default=0, help="the workload's seed")
    g.add_argument("--compare", default=None, metavar="BENCH_SERVE.json",
                   help="predict a saved bench serve run (its workload, budgets, rates, SLO) and print the "
                        "prediction beside what it measured, with the error of each")
    g.add_argument("--no-design", action="store_true", help=f"leave out the line of {DEFAULT_PRESET} on 8 B200s")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse options that do not go together (the bill's with ``--serve``'s), from the arguments alone."""
    if not args.serve:
        serve_only = [o for o, v in (("--profile", args.profile), ("--compare", args.compare), ("--link", args.link),
                                     ("--kv-share", args.kv_share), ("--rate", args.rate), ("--slo", args.slo))
                      if v is not None]
        if serve_only:
            raise InputError(f"{', '.join(serve_only)}: options of wsharding plan --serve; add --serve")
        return
    if args.profile is None:
        raise InputError("--serve needs --profile FILE (a profile or bench serve JSON) or --profile measure")
    bill_only = [o for o, v in (("--preset", args.preset), ("--model", args.model), ("--device", args.device),
                                ("--tokens", args.tokens), ("--dtype", args.dtype), ("--context", args.context),
                                ("--kv-bytes-per-token", args.kv_bytes_per_token), ("--kv-pool-gib", args.kv_pool_gib))
                 if v is not None] + (["--list"] if args.list else []) + (["--map-own-chunk"] if args.map_own_chunk else [])
    if bill_only:
        raise InputError(f"{', '.join(bill_only)}: options of the bill, not of --serve (its model is the profile's; "
                         "--link and --ranks say where it runs)")
    if args.compare:
        given = [o for o, v in (("--kv-share", args.kv_share), ("--rate", args.rate), ("--prompt", args.prompt),
                                ("--output", args.output), ("--requests", args.requests), ("--slo", args.slo),
                                ("--token-budget", args.token_budget), ("--warmup", args.warmup)) if v is not None]
        if given:
            raise InputError(f"{', '.join(given)}: --compare takes them from the bench serve run it predicts")
    if args.compare and args.profile == "measure":
        raise InputError("--compare predicts a saved bench serve run from a profile: give --profile FILE")
