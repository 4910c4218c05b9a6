"""What a user of the server sees, from per-request records: the result fields of vLLM's
``benchmark_serving`` and SGLang's ``bench_serving``, and goodput under SLOs (vLLM's ``--goodput``).

Per request, from the time it was sent: **TTFT** (to its first token), **ITL** (between consecutive
tokens), **TPOT** (``(E2E - TTFT) / (output - 1)``: the mean time per later token), **E2E** (to its
last token). Over a trial: their mean, p50, p90 and p99 (linear interpolation, as numpy's
``percentile``, which vLLM uses); request throughput, output and total tokens per second, per rank;
**goodput**, the requests per second per rank that met every SLO.

Steady state (:func:`trial_metrics`): the first ``warmup`` requests of each rank (by arrival) met an
empty server and are left out. The **drain** is the time from the last measured request's send to the
last token: a run of too few requests for its rate is mostly drain -- a burst, not a steady state --
and a rate that met the SLOs only so proves nothing (:data:`STEADY_DRAIN`). Trials repeat a point with
other seeds; a metric over trials is its mean, its standard deviation and the half-width of a 95 %
Student-t interval.

Two variants are judged as a **pair** (:func:`pair_metrics`, :func:`pair_steady`): they serve the same
arrivals, their goodput is counted over one window common to both -- the arrival window of the
measured requests -- so two variants that met the SLO for every request have the same goodput whatever
their drains; a variant that misses the SLO misses it whatever its drain; and a point proves a rate
only if the arrivals covered most of the time measured for every variant that met the SLO there. The
answer per variant is its highest sustained rate **bracketed** by the first rate it failed
(:func:`bracket`), and each point's **regime** says whether the replicated pool ran out (:func:`regime`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from wsharding.core.errors import InvalidArgument

#: Two-sided 95 % Student-t quantiles by degrees of freedom (1..30); above, the normal's 1.96 is near enough.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")

#: The largest share of a trial's measured time that may be its drain for the point to count as a
#: steady state: above it, requests kept arriving for less than half the time measured, so most of
#: them were served by a server emptying, not by one at its rate (a deployment never drains).
STEADY_DRAIN = 0.5


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds (None: not asked) and the share of requests that must
    meet them all for a rate to count as sustained (``attainment``)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            v = getattr(self, name)
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise InvalidArgument(f"SLO {name[:-3]}: need a number of milliseconds > 0, got {v}")
        if not 0 < self.attainment <= 1:
            raise InvalidArgument(f"SLO attainment: need a fraction in (0, 1], got {self.attainment}")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``ttft=MS,tpot=MS[,e2e=MS][,attainment=F]``."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot", "e2e", "attainment"):
                raise InvalidArgument(f"SLO {part!r}: give KEY=VALUE with KEY one of ttft, tpot, e2e (ms), attainment")
            try:
                values[key if key == "attainment" else key + "_ms"] = float(value)
            except ValueError:
                raise InvalidArgument(f"SLO {part!r}: {value!r} is not a number") from None
        if not any(k.endswith("_ms") for k in values):
            raise InvalidArgument(f"SLO {text!r}: name at least one of ttft, tpot, e2e")
        return cls(**values)

    def met(self, m: dict[str, Any]) -> bool:
        """Whether one request's metrics meet every objective (a one-token output has no TPOT to miss)."""
        return all(limit is None or m[key] is None or m[key] <= limit
                   for key, limit in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2e_ms", self.e2e_ms)))

    def describe(self) -> str:
        parts = [f"{k[:-3].upper()} <= {v:g} ms" for k, v in asdict(self).items() if k.endswith("_ms") and v is not None]
        return " and ".join(parts) + f" for {self.attainment:.0%} of requests"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """TTFT, TPOT, E2E (ms) and the ITLs (ms) of one request's record (:class:`~wsharding.serve.engine.ServeRun`)."""
    times = record["token_s"]
    sent = record["sent_s"]
    n = len(times)
    return {"ttft_ms": 1e3 * (times[0] - sent), "e2e_ms": 1e3 * (times[-1] - sent),
            "tpot_ms": 1e3 * (times[-1] - times[0]) / (n - 1) if n > 1 else None,
            "itl_ms": [1e3 * (b - a) for a, b in zip(times, times[1:], strict=False)]}


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile by linear interpolation between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stats(values: list[float]) -> dict[str, float | None]:
    """Mean, p50, p90, p99."""
    return {"mean": statistics.fmean(values) if values else None, "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def trial_metrics(records: list[dict[str, Any]], ranks: int, warmup: int, slo: SLO | None) -> dict[str, Any]:
    """One trial's metrics over every rank's ``records``; rates and throughputs per rank.

    Only the **measured** requests count: each rank's, but its first ``warmup`` (they met an empty
    server). The duration runs from the first measured request's send to the last measured request's
    last token -- vLLM's benchmark duration, over the measured requests; it includes the drain after
    the last arrival, as vLLM's does, which a run of many requests makes small: ``drain_share`` says
    how small (the drain's share of the duration). Goodput: the measured requests that met every SLO,
    per second."""
    measured = [r for r in records if r["rid"] >= warmup]
    if not measured:
        raise InvalidArgument(f"no request left to measure: {warmup} warm-up requests per rank of "
                              f"{len(records) // max(ranks, 1)}")
    per = [request_metrics(r) for r in measured]
    duration, drain, drain_share = measured_window([r["sent_s"] for r in measured], [r["token_s"][-1] for r in measured])
    rate = 1.0 / (duration * ranks) if duration > 0 else 0.0
    out_tokens = sum(r["output_tokens"] for r in measured)
    in_tokens = sum(r["prompt_tokens"] for r in measured)
    result: dict[str, Any] = {
        "measured": len(measured), "duration_s": duration, "drain_s": drain,
        "drain_share": drain_share, "request_throughput": len(measured) * rate,
        "output_throughput": out_tokens * rate, "total_throughput": (in_tokens + out_tokens) * rate,
        "preempted": sum(r["preempted"] for r in measured),
        "ttft_ms": stats([m["ttft_ms"] for m in per]), "e2e_ms": stats([m["e2e_ms"] for m in per]),
        "tpot_ms": stats([m["tpot_ms"] for m in per if m["tpot_ms"] is not None]),
        "itl_ms": stats([x for m in per for x in m["itl_ms"]]),
    }
    if slo is not None:
        good = sum(slo.met(m) for m in per)
        result["goodput"] = good * rate
        result["attainment"] = good / len(measured)
    return result


def interval(values: Iterable[float | None]) -> dict[str, float | None]:
    """Mean, standard deviation and the half-width of its 95 % Student-t interval (None with fewer than
    two values)."""
    xs = [v for v in values if v is not None]
    if not xs:
        return {"mean": None, "half": None, "std": None, "n": 0}
    if len(xs) == 1:
        return {"mean": xs[0], "half": None, "std": None, "n": 1}
    t = T95[len(xs) - 2] if len(xs) - 1 <= len(T95) else 1.96
    std = statistics.stdev(xs)
    return {"mean": statistics.fmean(xs), "half": t * std / math.sqrt(len(xs)), "std": std, "n": len(xs)}


def over_trials(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Every scalar of :func:`trial_metrics` (latencies: each statistic) as an :func:`interval` over trials."""
    out: dict[str, Any] = {}
    for key, value in trials[0].items():
        if isinstance(value, dict):
            out[key] = {k: interval(t[key][k] for t in trials) for k in value}
        else:
            out[key] = interval(t[key] for t in trials)
    return out


def is_steady(rate: float | None, drain_share: float | None) -> bool:
    """Whether a point of a sweep was a steady state: all at once is a declared burst (it counts as
    itself); at a rate, the drain was at most :data:`STEADY_DRAIN` of the time measured."""
    return rate is None or (drain_share is not None and drain_share <= STEADY_DRAIN)


def measured_window(sends: list[float], ends: list[float]) -> tuple[float, float, float]:
    """(duration, drain, drain share) of a trial's measured requests from their send times and last
    tokens: the duration from the first send to the last token, the drain from the last send to it."""
    end = max(ends)
    duration, drain = end - min(sends), end - max(sends)
    return duration, drain, drain / duration if duration > 0 else 1.0


def sweep_answer(rates: list[float], attainments: list[float | None], target: float,
                 steady: list[bool] | None = None) -> tuple[float | None, dict[str, Any] | None]:
    """The highest rate up to which every rate of the sweep (ascending) met the SLOs for ``target`` of
    its requests (mean over trials), None when the lowest did not; and where the sweep stopped --
    ``{"rate": r, "why": ...}``, None when every rate passed (the rate is then a lower bound).
    Requiring every lower rate too keeps one lucky point above a failing one from counting.
    ``steady``: per rate, whether it was a steady state (:data:`STEADY_DRAIN`); the sweep stops at
    the first that was not and met the SLOs (it proves nothing), as at one that missed them (a short
    run flatters a rate, so a miss in one stands)."""
    best = None
    steady = [True] * len(rates) if steady is None else steady
    for rate, a, ok in sorted(zip(rates, attainments, steady, strict=True), key=lambda x: x[0]):
        if a is None or a < target:
            return best, {"rate": rate, "why": "missed the SLO"}
        if not ok:
            return best, {"rate": rate, "why": "not a steady state"}
        best = rate
    return best, None



def arrival_window(records: list[dict[str, Any]], warmup: int) -> float:
    """Seconds the measured requests (rid >= ``warmup``) take to arrive, each counted with one mean gap:
    the span from the first to the last arrival times n / (n - 1). The span alone holds n - 1 gaps, so
    n requests over it would overstate the offered rate by n / (n - 1) (7 % at 15 requests); with the
    mean gap added, requests over the window is the rate the arrivals offered. 0 when they all arrive
    at once (or there is one)."""
    arrivals = [r["arrival_s"] for r in records if r["rid"] >= warmup]
    span = max(arrivals) - min(arrivals) if arrivals else 0.0
    return span * len(arrivals) / (len(arrivals) - 1) if span > 0 else 0.0


def pair_metrics(records: dict[str, list[dict[str, Any]]], ranks: int, warmup: int,
                 slo: SLO | None) -> dict[str, dict[str, Any]]:
    """One trial of every variant on the **same arrivals**: :func:`trial_metrics` per variant, with
    goodput and request throughput counted over one window common to all (``window_s``): the arrival
    window of the measured requests, or, when they all arrived at once, the longest variant's
    duration. Each variant's goodput over its own duration stays as ``goodput_own_window`` (what a
    benchmark that counts the drain reports). Variants whose arrivals differ are refused: a pair
    compares two servers on one stream of requests."""
    keys = {v: sorted((r["rank"], r["rid"], r["arrival_s"]) for r in recs) for v, recs in records.items()}
    first = next(iter(keys))
    for v, k in keys.items():
        if k != keys[first]:
            raise InvalidArgument(f"pair: {v} served other arrivals than {first}; a pair is judged on the same requests")
    out = {v: trial_metrics(recs, ranks, warmup, slo) for v, recs in records.items()}
    window = arrival_window(records[first], warmup)
    if window <= 0:
        window = max(m["duration_s"] for m in out.values())
    for m in out.values():
        n = m["measured"]
        m["window_s"] = window
        m["request_throughput_window"] = n / (window * ranks) if window > 0 else 0.0
        if slo is not None:
            m["goodput_own_window"] = m["goodput"]
            m["goodput"] = m["attainment"] * n / (window * ranks) if window > 0 else 0.0
    return out


def pair_steady(rate: float | None, drain_shares: dict[str, float | None], attainments: dict[str, float | None],
                target: float) -> bool:
    """Whether a point of a pair proves rates: all at once is a declared burst; at a rate, the arrivals
    covered most of the time measured (:func:`is_steady`) for **every variant that met the SLO** there.
    A variant that missed the SLO missed it whatever its drain, so its drain does not matter; one that
    met it during a long drain makes the point a burst for both (the same arrivals)."""
    return all(is_steady(rate, drain_shares[v]) for v, a in attainments.items() if a is not None and a >= target)


def bracket(rates: list[float], attainments: list[float | None], target: float,
            steady: list[bool] | None = None) -> dict[str, Any]:
    """One variant's answer over a sweep (:func:`sweep_answer`): ``sustained``, the highest rate met
    with every lower one; ``fails_at``, the first rate above it that missed the SLO (None where the
    sweep stopped at a point that was not a steady state, or nothing failed); ``stopped`` as
    :func:`sweep_answer` gives it; ``kind``: ``"bracketed"`` (a pass and a fail), ``"at least"`` (every
    rate passed), ``"below the lowest"`` (the lowest rate failed), ``"not established"`` (stopped by a
    point that proves nothing)."""
    best, stopped = sweep_answer(rates, attainments, target, steady)
    if stopped is None:
        kind = "at least"
    elif stopped["why"] == "missed the SLO":
        kind = "bracketed" if best is not None else "below the lowest"
    else:
        kind = "not established"
    return {"sustained": best, "fails_at": stopped["rate"] if kind in ("bracketed", "below the lowest") else None,
            "stopped": stopped, "kind": kind}


def bracket_json(b: dict[str, Any]) -> dict[str, Any]:
    """A :func:`bracket` as a saved report holds it (JSON has no infinity): all at once is the rate None
    and is said as such (``all_at_once``), never as a number. Returns a new dict."""
    b = {**b, "all_at_once": b["sustained"] is not None and math.isinf(b["sustained"])}
    for key in ("sustained", "fails_at"):
        if b[key] is not None and math.isinf(b[key]):
            b[key] = None
    if b["stopped"] is not None and math.isinf(b["stopped"]["rate"]):
        b["stopped"] = {**b["stopped"], "rate": None}
    return b


def _rate(rate: float | None) -> str:
    return "all at once" if rate is None or math.isinf(rate) else f"{rate:g}/s"


def bracket_text(b: dict[str, Any]) -> str:
    """A :func:`bracket` in words: "sustains 4/s, fails at 8/s"; "at least 8/s (nothing failed)";
    "below the lowest rate (2/s failed)"; "sustains 2/s, 8/s not a steady state (more requests)"."""
    if b.get("all_at_once"):
        return "all at once (a burst: every request at time 0 met the SLO)"
    best = None if b["sustained"] is None else _rate(b["sustained"])
    if b["kind"] == "bracketed":
        return f"sustains {best}, fails at {_rate(b['fails_at'])}"
    if b["kind"] == "at least":
        return f"at least {best} (nothing failed)"
    if b["kind"] == "below the lowest":
        return f"below the lowest rate ({_rate(b['fails_at'])} failed)"
    where = f"{_rate(b['stopped']['rate'])} not a steady state (more requests)"
    return f"sustains {best}, {where}" if best is not None else f"not established: {where}"


def regime(preemptions: float, waited_for_memory: float) -> str:
    """A point's regime, from the replicated variant's counts there: ``"pool-limited"`` when its pool
    ran out (a preemption, or a request that waited for memory), else ``"compute-limited"``."""
    return "pool-limited" if preemptions > 0 or waited_for_memory > 0 else "compute-limited"
