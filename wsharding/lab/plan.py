"""``wsharding plan``: the memory and traffic bill of weight sharding, before any GPU runs.

    wsharding plan                      # the design's own deployment: DEFAULT_PRESET, said on the first line
    wsharding plan --preset kimi-k3-b200-fp8 [--ranks N] [--bandwidth GBps] [--tokens T] [--json [PATH]]
    wsharding plan --model my_model.yaml --device h200 --ranks 4
    wsharding plan --list
    wsharding plan --serve --profile FILE|measure [--link measured|time-sliced|h200|b200] [--ranks N]
                   [--kv-share 0.05,0.3] [--rate 1,4] [--prompt LO:HI] [--output LO:HI] [--slo ttft=MS,tpot=MS]
                   [--compare BENCH_SERVE.json] [--json PATH]

A readable table by default (GiB = 2**30 B and GB = 10**9 B are both named); ``--json`` prints one
object whose byte counts are integers instead (see :meth:`wsharding.costmodel.Plan.to_dict`), and
``--json PATH`` writes it to PATH beside the table.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

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
    int_at_least,
    length_range,
    number_list,
    slo_arg,
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
    add_serve_arguments(p)


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
    if args.serve:
        return serve_main(args)
    serve_only = [o for o, v in (("--profile", args.profile), ("--compare", args.compare), ("--link", args.link),
                                 ("--kv-share", args.kv_share), ("--rate", args.rate), ("--slo", args.slo))
                  if v is not None]
    if serve_only:
        raise InputError(f"{', '.join(serve_only)}: options of wsharding plan --serve; add --serve")
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


# ---- plan --serve: a prediction of what the saving buys, the scheduler replayed -----------------------------

#: ``--link``: the profile's own steps, the profile's gathers in series, or a datasheet's NVLink with lookahead.
LINKS = ("measured", "time-sliced", "h200", "b200")






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


def load_profile(path: str) -> tuple[Any, dict[str, Any] | None]:
    """A :class:`~wsharding.serve.predict.StepProfile` from a profile JSON or a bench serve report (then
    also the report, under today's rules)."""
    from wsharding.io_checks import read_saved_report
    from wsharding.lab.bench.serve_report import read_serve_report
    from wsharding.lab.bench.serve_schema import SCHEMA
    from wsharding.serve.predict import StepProfile

    try:
        raw = read_saved_report(path)
    except ValueError as e:
        raise InputError(f"--profile {path}: not JSON ({e})") from None
    if isinstance(raw, dict) and raw.get("kind") == "serve prediction" and "profile" in raw:
        raw = raw["profile"]  # a prediction's JSON carries the profile it was made from
    if isinstance(raw, dict) and raw.get("bench") == "serve":
        if raw.get("schema") == SCHEMA:  # checked whole, its answers computed again
            report = read_serve_report(path)
            return StepProfile.from_serve_report(report, f"bench serve report {path}"), report
        # an old-format report: its measured step times only, each checked; its answer is never read
        return StepProfile.from_old_report_steps(raw, path), None
    if not isinstance(raw, dict) or raw.get("kind") != "step profile":
        raise InputError(f"--profile {path}: neither a step profile nor a bench serve report: give the JSON that "
                         "wsharding plan --serve --profile measure --json wrote, or one of bench serve --json")
    return StepProfile.from_dict(raw), None


def measure_profile(args: argparse.Namespace, token_budget: int, max_len: int) -> Any:
    """Time the profile now on ``--profile-ranks`` rank processes (:mod:`wsharding.lab.tasks.predict`)."""
    from wsharding.lab.bench.ranks import auto_comm, bench_cluster
    from wsharding.lab.tasks.predict import profile_from_ranks, profile_rank
    from wsharding.runtime import gpu_count
    from wsharding.serve.predict import StepProfile

    preset = args.decoder or ("k3-like" if gpu_count() else "tiny-deep")
    with bench_cluster(args.profile_ranks) as c:
        results = c.run(profile_rank, preset, token_budget=token_budget, max_len=max_len, comm=auto_comm("auto"))
    return StepProfile.from_dict(profile_from_ranks(results))


def serve_main(args: argparse.Namespace) -> int:
    """``wsharding plan --serve``: the prediction, its text, and with ``--json`` the object."""
    from wsharding.costmodel import get_device
    from wsharding.serve import Workload
    from wsharding.serve.metrics import SLO
    from wsharding.serve.predict import (
        Setting,
        StepModel,
        datasheet_gathers,
        design_prediction,
        design_text,
        format_comparison,
        format_prediction,
        predict_report,
        predict_serve,
    )

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
    if args.json:
        check_output_path(args.json if args.json != "-" else "", "--json")
    report = None
    if args.compare:
        from wsharding.lab.bench.serve_report import read_serve_report

        report = read_serve_report(args.compare)
    if args.profile == "measure":
        from wsharding.runtime import gpu_count

        gpus = bool(gpu_count())  # the bench serve defaults of this machine
        wl0 = Workload(prompt=args.prompt or ((64, 512) if gpus else (8, 24)),
                       output=args.output or ((64, 256) if gpus else (4, 16)))
        profile = measure_profile(args, args.token_budget or (512 if gpus else 64), wl0.max_len)
    else:
        profile, _ = load_profile(args.profile)
    link = args.link or "measured"
    ranks = args.ranks if args.ranks is not None else profile.ranks
    if ranks < 2:
        raise InputError(f"--ranks: a shard group needs at least 2 GPUs, got {ranks}")
    scale = 1.0 if args.compute_scale is None else args.compute_scale
    if link == "measured":
        if args.compute_scale is not None:
            raise InputError("--compute-scale: --link measured replays the steps as measured, gathers included; "
                             "scale compute with --link time-sliced, h200 or b200")
        if ranks != profile.ranks:
            raise InputError(f"--link measured replays the profile's own steps, measured on {profile.ranks} ranks: "
                             f"--ranks {ranks} needs --link h200 or b200 (gathers priced for {ranks} GPUs)")
        model = StepModel(profile, "measured")
    elif link == "time-sliced":
        model = StepModel(profile, "serial", link="measured, time-sliced", compute_scale=scale)
    else:
        dev = get_device(link)
        bw = dev.link_bandwidth if args.bandwidth is None else args.bandwidth * GB
        model = StepModel(profile, "overlap", datasheet_gathers(profile, ranks, bw, args.latency_us * 1e-6),
                          link=f"{ranks} x {link.upper()} NVLink at {bw / 1e9:g} GB/s, datasheet", compute_scale=scale)
    if report is not None:
        if ranks != report["world_size"]:
            raise InputError(f"--compare: the run had {report['world_size']} ranks, the prediction {ranks}: predict "
                             "the run's own ranks")
        pred = predict_report(profile, model, report)
        slo = SLO(**report["slo"])
        text = format_prediction(pred) + "\n" + format_comparison(pred["comparison"])
    else:
        cpu = profile.device == "cpu"
        wl = Workload(requests=args.requests or (60 if cpu else 200), prompt=args.prompt or ((8, 24) if cpu else (64, 512)),
                      output=args.output or ((4, 16) if cpu else (64, 256)), seed=args.seed)
        slo = args.slo or (SLO(ttft_ms=3000, tpot_ms=300) if cpu else SLO(ttft_ms=2000, tpot_ms=200))
        setting = Setting(ranks=ranks, workload=wl, token_budget=args.token_budget or profile.token_budget, slo=slo,
                          vocab=profile.vocab, trials=args.trials, warmup=args.warmup)
        pred = predict_serve(profile, model, setting, args.kv_share or [0.05, 0.3], args.rate or [1.0],
                             search=not args.no_search)
        text = format_prediction(pred)
    if not args.no_design:
        pred["design"] = design_prediction(slo, efficiency=args.efficiency)
        text += "\n" + design_text(pred["design"])
    pred["profile"] = profile.as_dict()
    if args.json != "-":
        print(text)
    written = emit_json(pred, args.json)
    if written:
        print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    parser = OneLineParser(prog="python -m wsharding.lab.plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
