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
from wsharding.lab.args.plan import DEFAULT_PRESET as DEFAULT_PRESET
from wsharding.lab.args.plan import LINKS as LINKS
from wsharding.lab.args.plan import add_arguments as add_arguments
from wsharding.lab.args.plan import add_serve_arguments as add_serve_arguments
from wsharding.lab.args.plan import check_arguments
from wsharding.lab.cliargs import (
    InputError,
    OneLineParser,
    check_output_path,
    emit_json,
)
from wsharding.presets import list_presets, load_preset


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
    check_arguments(args)
    if args.serve:
        return serve_main(args)
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
