"""The course's calculator (:mod:`wsharding.lab.calculator`), checked against numbers worked out here by hand.

The preset is the design's BF16 MoE peripherals: 92 identical layers of 367 000 000 bytes (183.5 M BF16
parameters) on 8 B200s (900 GB/s, 2.25 PFLOP/s dense BF16), 256 tokens per step, a 40 GiB KV pool of
26 496 B per token, requests of 8192 tokens. 367 000 000 is 64 past a multiple of 16 * 8, so every flat
layer is padded to 367 000 064 bytes at N = 8 (and to nothing at N = 4: it is a multiple of 16 * 4).
"""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path

import pytest

from wsharding.core.errors import NotFound
from wsharding.lab.calculator import STAGES, Calculator
from wsharding.lab.printing import WIDTH

LAYERS, PAYLOAD, T = 92, 367_000_000, 367_000_064
CHUNK = T // 8
R = LAYERS * PAYLOAD
SHARDED = LAYERS * CHUNK + 2 * T
NET = R - SHARDED
KV, POOL, CONTEXT = 26_496, 40 * 2**30, 8192
GATHER_S = Fraction(7 * CHUNK, 900 * 10**9)                  # one layer's gather at 900 GB/s
GEMM_S_PER_TOKEN = Fraction(2 * 183_500_000, 2250 * 10**12)  # one layer's sharded GEMMs per token

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


@pytest.fixture(scope="module")
def calc() -> Calculator:
    return Calculator.design("kimi-k3-b200-moe-bf16")


def test_the_bill_of_notebook_00(calc):
    v = {row.name: row.value for row in calc.stage("00")}
    assert v["replicated weights per GPU (R)"] == R == 33_764_000_000
    assert v["sharded: chunks + two slots"] == SHARDED == 4_954_500_864
    assert v["net saving per GPU"] == NET == 28_809_499_136
    assert v["gathered per rank, largest layer"] == 7 * CHUNK == 321_125_056
    assert v["break-even tokens per step"] == math.ceil(GATHER_S / GEMM_S_PER_TOKEN) == 2188
    assert v["KV tokens the net saving buys"] == NET // KV


def test_each_later_stage_adds_its_rows(calc):
    assert calc.value("01", "padding of the flat layouts") == LAYERS * 64
    assert calc.value("01", "chunk per rank, largest layer") == CHUNK == 45_875_008
    assert calc.value("02", "received per rank per step") == LAYERS * 7 * CHUNK
    assert calc.value("02", "every gather of a step, back to back") == pytest.approx(float(LAYERS * GATHER_S), rel=1e-12)
    # lookahead: the first gather is exposed, every later one by what it outlasts the layer before
    exposed = GATHER_S + (LAYERS - 1) * max(Fraction(0), GATHER_S - 256 * GEMM_S_PER_TOKEN)
    assert calc.value("03", "exposed gather per step, lookahead 1") == pytest.approx(float(exposed), rel=1e-12)
    assert calc.value("03", "slots at lookahead depth 2") == 3 * T
    one_weight = calc.plan.largest_weight_bytes
    assert calc.value("04", "load peak, rows read per rank") == SHARDED + one_weight
    assert calc.value("04", "load peak, requantized whole first") == R + SHARDED
    assert [(row.name, row.value) for row in calc.stage("05")] == [("moe_peripherals (replicated linears)", R)]
    assert calc.value("06", "net saving, shard groups of 4") == R - LAYERS * (PAYLOAD // 4) - 2 * PAYLOAD
    assert calc.value("07", "KV tokens per GPU, replicated") == POOL // KV
    assert calc.value("07", "KV tokens per GPU, sharded") == (POOL + NET) // KV
    assert calc.value("07", "more requests of 8,192 tokens") == (POOL + NET) // (KV * CONTEXT) - POOL // (KV * CONTEXT)
    decode = GATHER_S + (LAYERS - 1) * (GATHER_S - GEMM_S_PER_TOKEN)
    assert calc.value("08", "exposed gather per step at 1 token") == pytest.approx(float(decode), rel=1e-12)
    assert calc.value("08", "break-even tokens, link at half speed") == math.ceil(2 * GATHER_S / GEMM_S_PER_TOKEN) == 4376


def test_so_far_reads_every_stage_up_to_the_notebook_and_fits_the_output_area(calc):
    assert [row.stage for row in calc.so_far("02")] == ["00"] * 6 + ["01"] * 2 + ["02"] * 2
    text = calc.table("08")
    assert text.splitlines()[0].startswith("the calculator, notebooks 00-08: kimi-k3-b200-moe-bf16 on 8 x B200")
    assert len(text.splitlines()) == 1 + len(calc.so_far("08"))
    assert max(map(len, text.splitlines())) <= WIDTH
    with pytest.raises(NotFound, match="stages 00, 01"):
        calc.stage("09")


def test_another_deployment_is_priced_again_not_scaled():
    four = Calculator.design("kimi-k3-b200-moe-bf16", ranks=4, device="h200")
    assert four.value("00", "sharded: chunks + two slots") == LAYERS * (PAYLOAD // 4) + 2 * PAYLOAD
    assert four.deployment.bandwidth == 450 * 10**9
    odd = Calculator.design("kimi-k3-b200-moe-bf16", ranks=3)
    assert [row.value for row in odd.stage("06")] == [None]  # no two equal groups: said, not guessed


def test_every_notebook_prints_the_calculator_of_its_stage():
    """Each notebook has one cell printing the calculator up to its own stage (package code, not a copy)."""
    for nb in STAGES:
        (path,) = NOTEBOOKS.glob(f"{nb}_*.ipynb")
        cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        calls = [c for c in cells if re.search(r"\.table\(\"(\d\d)\"\)", c)]
        assert len(calls) == 1, f"{path.name}: {len(calls)} calculator cells"
        assert f'.table("{nb}")' in calls[0], f"{path.name} prints another notebook's stage"
