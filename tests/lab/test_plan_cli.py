"""``wsharding plan``: the acceptance figures through the command line, and its error messages."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from wsharding.costmodel import GiB
from wsharding.lab import plan


def run_plan(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    rc = plan.main(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_kimi_k3_fp8_json(capsys):
    rc, out, _ = run_plan(["--preset", "kimi-k3-b200-fp8", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert d["preset"] == "kimi-k3-b200-fp8" and d["ranks"] == 8 and d["layers"] == 92
    assert round(d["replicated_bytes"] / GiB, 2) == 48.79
    assert [(g["name"], round(g["replicated_bytes"] / GiB, 2)) for g in d["groups"]] == [
        ("kda_projections", 28.50), ("moe_peripherals", 15.72), ("mla_projections", 4.57)]
    assert sum(g["replicated_bytes"] for g in d["groups"]) == d["replicated_bytes"]


def test_kimi_k3_moe_bf16_json_exact(capsys):
    rc, out, _ = run_plan(["--preset", "kimi-k3-b200-moe-bf16", "--ranks", "8", "--json"], capsys)
    d = json.loads(out)
    R, T = 367_000_000 * 92, 367_000_064
    assert rc == 0 and d["replicated_bytes"] == R
    assert d["net_saving_bytes"] == 7 * R // 8 - 2 * T - 92 * 64 // 8
    assert d["slot_bytes"] == 2 * T
    assert d["sharded_resident_bytes"] == R - d["net_saving_bytes"]
    assert d["allgather_bytes_per_rank_per_layer"] == 7 * T // 8
    assert d["breakeven_tokens"] > 0


def test_options_change_the_plan(capsys):
    base = json.loads(run_plan(["--preset", "kimi-k3-b200-moe-bf16", "--json"], capsys)[1])
    d = json.loads(run_plan(["--preset", "kimi-k3-b200-moe-bf16", "--json", "--ranks", "4", "--bandwidth", "450",
                             "--tokens", "64", "--dtype", "fp8_e4m3", "--kv-bytes-per-token", "1000",
                             "--context", "100"], capsys)[1])
    assert d["ranks"] == 4 and d["tokens"] == 64 and d["bandwidth_bytes_per_s"] == 450e9
    assert d["replicated_bytes"] * 2 == base["replicated_bytes"]
    assert d["extra_kv_tokens"] == d["net_saving_bytes"] // 1000
    assert d["extra_requests"] == d["extra_kv_tokens"] // 100


def test_table_names_gross_and_net_and_units(capsys):
    rc, out, _ = run_plan(["--preset", "kimi-k3-b200-moe-bf16"], capsys)
    assert rc == 0
    assert "gross saving R (the design's 'reclaimed'): 31.45 GiB" in out
    assert "net saving, after the two slots:" in out and "GB)" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "nope"], "preset: unknown preset 'nope'"),
    (["--preset", "kimi-k3-b200-fp8", "--ranks", "0"], "ranks: must be >= 1"),
    (["--preset", "kimi-k3-b200-fp8", "--bandwidth", "-1"], "bandwidth: must be a positive"),
    (["--preset", "kimi-k3-b200-fp8", "--dtype", "fp7"], "dtype: unknown dtype 'fp7'"),
    (["--preset", "kimi-k3-b200-fp8", "--device", "a100"], "device: unknown device 'a100'"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    rc, out, err = run_plan(argv, capsys)
    assert rc == 2 and out == ""
    assert message in err


def test_model_file_errors(tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"name": "m", "kinds": {"a": {"groups": [{"name": "w", "dtype": "bf16", "bytes": -4}]}},
                             "sequence": [["a", 2]]}))
    rc, _, err = run_plan(["--model", str(f)], capsys)
    assert rc == 2 and "m.kinds.a.w.bytes: must be >= 1" in err


def test_list(capsys):
    rc, out, _ = run_plan(["--list"], capsys)
    assert rc == 0 and "kimi-k3-b200-fp8" in out


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "wsharding.lab.plan", "--preset", "kimi-k3-b200-fp8", "--json"],
                       capture_output=True, text=True, check=True)
    assert json.loads(r.stdout)["replicated_bytes"] == 30_601_641_984 + 4_907_000_136 + 92 * 183_500_000


def test_wsharding_cli_plan(capsys):
    from wsharding.lab import cli

    assert cli.main(["plan", "--preset", "kimi-k3-b200-moe-bf16", "--ranks", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicated_bytes"] == 92 * 367_000_000


@pytest.mark.parametrize("json_out", [False, True])
def test_no_arguments_plans_the_design_deployment_and_says_so(json_out, capsys):
    """`wsharding plan` alone prices the deployment the design starts from (it failed with
    "give --preset NAME or --model FILE"), and its first line says which preset that is; with --json
    the line goes to stderr and stdout stays one JSON object."""
    rc, out, err = run_plan(["--json"] if json_out else [], capsys)
    assert rc == 0
    said = err if json_out else out.splitlines()[0]
    assert f"no --preset or --model given: pricing {plan.DEFAULT_PRESET}, the deployment the weight-sharding" in said
    if json_out:
        assert json.loads(out)["preset"] == plan.DEFAULT_PRESET
    else:
        assert "48.79 GiB" in out or "48.8" in out  # the design's 48.8 GiB of replicated weights
    rc, out, err = run_plan(["--preset", plan.DEFAULT_PRESET], capsys)
    assert rc == 0 and "no --preset" not in out + err
