"""What a user sees, from hand-built request records: latencies, the steady-state window, goodput,
intervals over trials, the highest rate sustained."""

from __future__ import annotations

import math

import pytest

from wsharding.core.errors import InvalidArgument
from wsharding.serve.metrics import SLO, interval, percentile, request_metrics, sweep_answer, trial_metrics


def _rec(rid: int, sent: float, tokens: list[float], prompt: int = 10) -> dict:
    return {"rid": rid, "rank": 0, "arrival_s": sent, "sent_s": sent, "prompt_tokens": prompt,
            "output_tokens": len(tokens), "token_s": tokens, "preempted": 0}


RECORDS = [_rec(0, 0.0, [0.1, 0.2, 0.4]), _rec(1, 0.5, [0.6, 0.7]), _rec(2, 1.0, [1.3])]


def test_request_latencies():
    m = request_metrics(RECORDS[0])
    assert m["ttft_ms"] == pytest.approx(100) and m["e2e_ms"] == pytest.approx(400)
    assert m["tpot_ms"] == pytest.approx(150) and m["itl_ms"] == pytest.approx([100, 200])
    assert request_metrics(RECORDS[2])["tpot_ms"] is None  # one token: no time per later token


def test_a_trial_counts_the_measured_requests_from_the_first_send_to_the_last_token():
    t = trial_metrics(RECORDS, ranks=1, warmup=1, slo=SLO(ttft_ms=200))
    # measured: requests 1 and 2; duration: request 1's send (0.5 s) to request 2's last token (1.3 s)
    assert t["measured"] == 2 and t["duration_s"] == pytest.approx(0.8)
    assert t["request_throughput"] == pytest.approx(2.5) and t["output_throughput"] == pytest.approx(3.75)
    assert t["total_throughput"] == pytest.approx(23 / 0.8)  # and their 10-token prompts
    assert t["ttft_ms"]["mean"] == pytest.approx(200) and t["ttft_ms"]["p50"] == pytest.approx(200)
    assert t["attainment"] == 0.5 and t["goodput"] == pytest.approx(1.25)  # request 2's TTFT is 300 ms
    # the drain: request 2's send (1.0 s) to its last token (1.3 s), of the 0.8 s measured
    assert t["drain_s"] == pytest.approx(0.3) and t["drain_share"] == pytest.approx(0.375)
    halved = trial_metrics(RECORDS, ranks=2, warmup=1, slo=None)
    assert halved["request_throughput"] == pytest.approx(1.25) and "goodput" not in halved  # per rank


def test_all_at_once():
    burst = [_rec(0, 0.0, [0.5, 1.0]), _rec(1, 0.0, [0.5, 2.0])]
    t = trial_metrics(burst, ranks=1, warmup=0, slo=None)
    assert t["duration_s"] == pytest.approx(2.0) and t["request_throughput"] == pytest.approx(1.0)


def test_percentiles_intervals_and_the_highest_rate():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert percentile([], 99) is None
    iv = interval([1.0, 2.0, 3.0])
    assert iv["mean"] == 2.0 and iv["half"] == pytest.approx(4.303 / math.sqrt(3)) and iv["n"] == 3
    assert interval([5.0])["half"] is None
    # 8/s met again, but 4/s did not: the answer is 2/s
    assert sweep_answer([8.0, 1.0, 2.0, 4.0], [0.95, 1.0, 0.95, 0.5], 0.9) == (2.0, {"rate": 4.0, "why": "missed the SLO"})
    assert sweep_answer([1.0], [0.5], 0.9) == (None, {"rate": 1.0, "why": "missed the SLO"})
    assert sweep_answer([1.0, 2.0], [1.0, 0.95], 0.9) == (2.0, None)  # every rate passed: 2/s is a lower bound


def test_a_rate_met_only_in_a_drain_proves_nothing():
    """Without the steady flags, a sweep of short runs claims its highest rate: every request arrived
    in a burst and was served by a server emptying, at no rate at all."""
    met = [1.0, 1.0, 1.0]
    assert sweep_answer([2.0, 16.0, 32.0], met, 0.9) == (32.0, None)
    assert sweep_answer([2.0, 16.0, 32.0], met, 0.9, steady=[True, False, True]) == (
        2.0, {"rate": 16.0, "why": "not a steady state"})
    assert sweep_answer([16.0, 32.0], [1.0, 1.0], 0.9, steady=[False, False])[0] is None
    # a miss stands even where the run was not steady: a short run only flatters a rate
    assert sweep_answer([2.0, 16.0], [1.0, 0.5], 0.9, steady=[True, False])[1] == {"rate": 16.0, "why": "missed the SLO"}


def test_slo_met_and_described():
    slo = SLO(ttft_ms=100, tpot_ms=10)
    assert slo.met({"ttft_ms": 100, "tpot_ms": None, "e2e_ms": 5}) and not slo.met({"ttft_ms": 1, "tpot_ms": 11, "e2e_ms": 5})
    assert slo.describe() == "TTFT <= 100 ms and TPOT <= 10 ms for 90% of requests"


def _stream(sends: list[float], last_tokens: list[float]) -> list[dict]:
    """Requests sent (= arrived) at ``sends``, each of two tokens, the first 10 ms after its send."""
    return [_rec(i, s, [s + 0.01, e]) for i, (s, e) in enumerate(zip(sends, last_tokens, strict=True))]


# the same arrivals, 1 s apart; replicated drains at once, sharded's last request ends 3.5 s after its arrival
ARRIVALS = [0.0, 1.0, 2.0, 3.0]
FAST = _stream(ARRIVALS, [0.2, 1.2, 2.2, 3.2])
SLOW = _stream(ARRIVALS, [0.3, 1.3, 2.3, 6.5])


def test_goodput_over_the_common_window_is_the_same_for_two_variants_that_met_every_slo():
    """Every request met the SLO in both: over each variant's own window (first send to last token,
    the drain counted) the ratio is 3.2 / 6.5 = 0.49x; over the arrival window common to both it is 1."""
    from wsharding.serve.metrics import pair_metrics

    slo = SLO(ttft_ms=100, e2e_ms=5000)
    pair = pair_metrics({"replicated": FAST, "sharded": SLOW}, ranks=1, warmup=0, slo=slo)
    assert pair["replicated"]["attainment"] == pair["sharded"]["attainment"] == 1.0
    own = pair["sharded"]["goodput_own_window"] / pair["replicated"]["goodput_own_window"]
    assert own == pytest.approx(3.2 / 6.5)
    assert pair["sharded"]["goodput"] / pair["replicated"]["goodput"] == 1.0
    # four arrivals 1 s apart offer 1/s: the window holds one mean gap per request (3 s of span * 4 / 3), so a
    # variant that met every SLO has the goodput of the offered rate, not 4/3 of it
    assert pair["replicated"]["window_s"] == pair["sharded"]["window_s"] == 4.0 and pair["sharded"]["goodput"] == 1.0
    with pytest.raises(InvalidArgument, match="sharded served other arrivals than replicated"):
        pair_metrics({"replicated": FAST, "sharded": _stream([0.0, 1.0, 2.0, 3.5], [1, 2, 3, 4])}, 1, 0, slo)


def test_a_point_is_judged_as_a_pair():
    """Both met the SLO on the same arrivals; the sharded run's drain was 3.5 s of 6.5 (54 %). Judged per
    variant (the rule before) the replicated sustains the rate and the sharded 'is not a steady state' on
    the very arrivals the other passed -- a win for the replicated model out of nothing. Judged as a pair
    the arrivals did not cover most of the time measured for a variant that met the SLO: the point
    proves no rate for either. A variant that missed the SLO misses it whatever its drain."""
    from wsharding.serve.metrics import is_steady, pair_metrics, pair_steady

    pair = pair_metrics({"replicated": FAST, "sharded": SLOW}, ranks=1, warmup=0, slo=SLO(ttft_ms=100, e2e_ms=5000))
    drains = {v: m["drain_share"] for v, m in pair.items()}
    assert drains["sharded"] == pytest.approx(3.5 / 6.5) and drains["replicated"] == pytest.approx(0.2 / 3.2)
    old = {v: sweep_answer([2.0, 4.0], [1.0, 1.0], 0.9, [True, is_steady(4.0, d)])[0] for v, d in drains.items()}
    assert old == {"replicated": 4.0, "sharded": 2.0}
    met = {v: m["attainment"] for v, m in pair.items()}
    assert not pair_steady(4.0, drains, met, 0.9)
    new = {v: sweep_answer([2.0, 4.0], [1.0, 1.0], 0.9, [True, pair_steady(4.0, drains, met, 0.9)])[0] for v in drains}
    assert new == {"replicated": 2.0, "sharded": 2.0}
    # the sharded variant missed (attainment 0.5): its drain no longer matters, the point stands
    assert pair_steady(4.0, drains, {"replicated": 1.0, "sharded": 0.5}, 0.9)
    assert pair_steady(None, drains, met, 0.9)  # all at once: a declared burst


def test_the_answer_is_bracketed():
    from wsharding.serve.metrics import bracket, bracket_text

    rates = [2.0, 4.0, 8.0]
    b = bracket(rates, [1.0, 0.95, 0.4], 0.9)
    assert (b["sustained"], b["fails_at"], b["kind"]) == (4.0, 8.0, "bracketed")
    assert bracket_text(b) == "sustains 4/s, fails at 8/s"
    b = bracket(rates, [1.0, 1.0, 0.95], 0.9)
    assert (b["sustained"], b["fails_at"], b["kind"]) == (8.0, None, "at least")
    assert bracket_text(b) == "at least 8/s (nothing failed)"
    b = bracket(rates, [0.5, 1.0, 1.0], 0.9)
    assert (b["sustained"], b["fails_at"], b["kind"]) == (None, 2.0, "below the lowest")
    assert bracket_text(b) == "below the lowest rate (2/s failed)"
    b = bracket(rates, [1.0, 1.0, 0.2], 0.9, steady=[True, False, True])
    assert (b["sustained"], b["fails_at"], b["kind"]) == (2.0, None, "not established")
    assert bracket_text(b) == "sustains 2/s, 4/s not a steady state (more requests)"
    assert bracket_text(bracket(rates, [None, 1.0, 1.0], 0.9)) == "below the lowest rate (2/s failed)"  # no figure: a miss


def test_regime():
    from wsharding.serve.metrics import regime

    assert regime(0, 0) == "compute-limited"
    assert regime(3, 0) == regime(0, 1) == regime(0.5, 0) == "pool-limited"


def test_interval_has_the_spread():
    iv = interval([1.0, 2.0, 3.0])
    assert iv["std"] == 1.0 and iv["half"] == pytest.approx(4.303 / math.sqrt(3))
    assert interval([2.0])["std"] is None
