"""The schema of a saved ``wsharding bench serve`` report, checked before any figure of it is read.

A report read back (``bench serve --from-json``) is printed as an answer, so a figure out of its range
must not become one: a NaN attainment read as met, an attainment of 7.5, a rate of -20 ("at least
-20/s"), a negative goodput, "every token equal" beside a list of differing tokens. :func:`parse_report`
reads the JSON refusing NaN and infinities and nesting deeper than a report has; :func:`check_report`
checks every field the report's text, answer and figures read -- present, of its type, in its range --
and answers in one line that names the field and what to do. A report of an earlier schema is refused
by name: the benchmark that wrote it ran the variants one after the other and judged each alone, so
its answer is not one judged as a pair.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from wsharding.core.errors import InvalidArgument

#: The schema of a report ``bench serve`` writes and this version reads; older ones are refused by name.
SCHEMA = 3
#: The deepest nesting a report has (a point's latency interval is 6 levels down; the request records 3).
MAX_DEPTH = 12
#: What a refusal tells the user to do.
TODO = "pass the .json that wsharding bench serve --json wrote, unchanged, or run the benchmark again"


class ReportRefused(InvalidArgument):
    """A saved serve report that is not one, or is of an earlier schema."""


def _refuse(path: Any, what: str) -> ReportRefused:
    return ReportRefused(f"{path}: {what}; {TODO}")


def parse_report(text: str, path: str | os.PathLike[str]) -> Any:
    """The JSON of ``text``, refused in one line when it is not JSON, holds NaN or an infinity (a
    figure of no value), or nests deeper than :data:`MAX_DEPTH`."""
    def constant(name: str) -> float:
        raise InvalidArgument(f"holds {name}, which is no figure")

    def number(literal: str) -> float:
        x = float(literal)
        if not math.isfinite(x):
            raise InvalidArgument(f"holds the number {literal[:20]}, too large for a float")
        return x

    try:
        report = json.loads(text, parse_constant=constant, parse_float=number)
    except json.JSONDecodeError as e:
        raise _refuse(path, f"not JSON ({e})") from None
    except (ValueError, RecursionError) as e:
        raise _refuse(path, f"not a report's JSON: it {e}") from None
    stack = [(report, 1)]
    while stack:
        node, level = stack.pop()
        if level > MAX_DEPTH:
            raise _refuse(path, f"nested deeper than a serve report ({MAX_DEPTH} levels)")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack += [(c, level + 1) for c in children if isinstance(c, (dict, list))]
    return report


class _Checker:
    """Checks fields of one report, each named by its path (``rows_by_budget[0].points[1].sharded.attainment.mean``)."""

    def __init__(self, path: Any) -> None:
        self.path = path

    def fail(self, field: str, problem: str) -> ReportRefused:
        return _refuse(self.path, f"field {field} {problem}")

    def get(self, obj: dict[str, Any], key: str, where: str) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(where, "is not an object")
        if key not in obj:
            raise self.fail(f"{where}.{key}" if where else key, "is missing")
        return obj[key]

    def num(self, value: Any, field: str, *, lo: float | None = None, hi: float | None = None, above: bool = False,
            none: bool = False, integer: bool = False) -> Any:
        if value is None:
            if none:
                return None
            raise self.fail(field, "is null, a number is needed")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            raise self.fail(field, f"is {type(value).__name__} {str(value)[:40]!r}, "
                                   f"{'a whole number' if integer else 'a number'} is needed")
        if isinstance(value, int) and abs(value) > 2**63:  # math.isfinite would overflow converting it
            raise self.fail(field, f"is a whole number of {len(str(abs(value)))} digits, too large for a report")
        if not math.isfinite(value):
            raise self.fail(field, f"is {value}, a finite number is needed")
        if lo is not None and (value <= lo if above else value < lo):
            raise self.fail(field, f"is {value:g}, it must be {'>' if above else '>='} {lo:g}")
        if hi is not None and value > hi:
            raise self.fail(field, f"is {value:g}, it must be <= {hi:g}")
        return value

    def field(self, obj: dict[str, Any], key: str, where: str, kind: Any = None, **bounds: Any) -> Any:
        value = self.get(obj, key, where)
        name = f"{where}.{key}" if where else key
        if kind is None:
            return self.num(value, name, **bounds)
        if kind is str and not (isinstance(value, str) or (bounds.get("none") and value is None)):
            raise self.fail(name, "is not a string")
        if kind is bool and not isinstance(value, bool):
            raise self.fail(name, "is not true or false")
        if kind is list and not isinstance(value, list):
            raise self.fail(name, "is not a list")
        if kind is dict and not (isinstance(value, dict) or (bounds.get("none") and value is None)):
            raise self.fail(name, "is not an object")
        return value

    def interval(self, obj: dict[str, Any], key: str, where: str, lo: float | None = 0.0,
                 hi: float | None = None, above: bool = False, none: bool = True) -> None:
        """An interval over trials (:func:`~wsharding.serve.metrics.interval`): mean in range (or null
        where ``none``: a figure no trial had)."""
        iv = self.field(obj, key, where, dict)
        name = f"{where}.{key}"
        self.field(iv, "mean", name, lo=lo, hi=hi, above=above, none=none)
        self.field(iv, "half", name, lo=0.0, none=True)
        self.field(iv, "n", name, lo=0, integer=True)
        if "std" in iv:
            self.field(iv, "std", name, lo=0.0, none=True)

    def rate(self, value: Any, field: str) -> None:
        """A request rate: null (all at once) or a number > 0."""
        self.num(value, field, lo=0.0, above=True, none=True)


def _check_point(c: _Checker, p: dict[str, Any], where: str, variants: list[str], slo: bool) -> None:
    c.interval(p, "realised_rate", where, lo=0.0, above=True)
    for v in variants:
        x = c.field(p, v, where, dict)
        w = f"{where}.{v}"
        for key in ("request_throughput", "output_throughput", "peak_blocks", "waited_for_memory", "preemptions",
                    "recomputed_tokens", "peak_in_flight", "idle_steps"):
            c.interval(x, key, w)
        c.interval(x, "drain_share", w, hi=1.0)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            lat = c.field(x, key, w, dict)
            for stat in ("mean", "p50", "p90", "p99"):
                c.interval(lat, stat, f"{w}.{key}")
        if slo:
            c.interval(x, "goodput", w, none=False)
            c.interval(x, "attainment", w, hi=1.0, none=False)
        c.field(x, "max_concurrency", w, lo=0, integer=True)
        buckets = c.field(x, "step_ms_by_bucket", w, dict)
        for k, b in buckets.items():
            bw = f"{w}.step_ms_by_bucket.{k}"
            if not k.isdigit():
                raise c.fail(bw, "is not a token bucket (a whole number of tokens)")
            c.field(b, "steps", bw, lo=1, integer=True)
            c.field(b, "working", bw, lo=0, integer=True)
            c.field(b, "mean_ms", bw, lo=0.0)
        for i, trace in enumerate(c.field(x, "kv_blocks", w, list)):
            tw = f"{w}.kv_blocks[{i}]"
            ts, bs = c.field(trace, "t", tw, list), c.field(trace, "blocks", tw, list)
            if len(ts) != len(bs):
                raise c.fail(tw, f"has {len(ts)} times for {len(bs)} block counts")
            for j, (t, b) in enumerate(zip(ts, bs, strict=True)):
                c.num(t, f"{tw}.t[{j}]")
                c.num(b, f"{tw}.blocks[{j}]", lo=0, integer=True)


def check_report(report: Any, path: str | os.PathLike[str]) -> None:
    """Refuse, in one line naming the field, a saved serve report any figure of which is missing, of
    another type or out of its range; and a report of an earlier schema, by name."""
    from wsharding.serve.metrics import SLO

    c = _Checker(path)
    if isinstance(report, dict) and report.get("bench") == "serve-engine":
        raise ReportRefused(f"{path}: a report of wsharding bench serve --engine transformers: --from-json reads the "
                            "reports of the package's own scheduler, whose fields this engine does not give (KV blocks "
                            "in use, waits, regimes); read the engine's JSON as it is, or the text its run printed")
    if not isinstance(report, dict) or report.get("bench") != "serve":
        raise ReportRefused(f"{path}: not a report of wsharding bench serve (its 'bench' field is not 'serve'); {TODO}")
    schema = report.get("schema")
    if schema != SCHEMA:
        if schema is None or (isinstance(schema, int) and not isinstance(schema, bool) and 0 < schema < SCHEMA):
            which = "no schema: the fixed-row benchmark" if schema is None else f"schema {schema}"
            raise ReportRefused(
                f"{path}: an old-format serve report ({which}): its benchmark ran the variants one after the "
                "other, counted each variant's goodput over its own drain and judged steady states per variant, so "
                f"its answer is not judged as a pair and is not read; run wsharding bench serve again (schema {SCHEMA})")
        raise c.fail("schema", f"is {str(schema)[:20]}, this version reads schema {SCHEMA}")
    for key in ("mode", "device", "communicator", "preset", "dtype", "workload_text"):
        c.field(report, key, "", str)
    c.field(report, "emulation", "", str, none=True)
    c.field(report, "slo_text", "", str, none=True)
    for key in ("world_size", "ranks_per_device", "layers", "kv_bytes_per_token", "token_budget", "max_context",
                "trials"):
        c.field(report, key, "", lo=1, integer=True)
    c.field(report, "warmup_requests", "", lo=0, integer=True)
    for key in ("max_seqs", "max_concurrency"):
        c.field(report, key, "", lo=1, integer=True, none=True)
    c.field(report, "device_memory_bytes", "", lo=1, integer=True, none=True)
    for i, n in enumerate(c.field(report, "notes", "", list)):
        if not isinstance(n, str):
            raise c.fail(f"notes[{i}]", "is not a string")
    rates = c.field(report, "rates", "", list)
    if not rates:
        raise c.fail("rates", "is empty")
    for i, r in enumerate(rates):
        c.rate(r, f"rates[{i}]")
    budgets = c.field(report, "budgets", "", list)
    for i, b in enumerate(budgets):
        c.num(b, f"budgets[{i}]", lo=0, above=True, integer=True)
    slo = c.field(report, "slo", "", dict, none=True)
    if slo is not None:
        try:
            SLO(**slo)
        except (TypeError, InvalidArgument) as e:
            raise c.fail("slo", f"is not an SLO ({str(e)[:120]})") from None
    variants = c.field(report, "variants", "", list)
    if len(variants) < 2 or variants[0] != "replicated" or not all(isinstance(v, str) for v in variants) \
            or len(set(variants)) != len(variants) or any(v in ("rate", "realised_rate") for v in variants):
        raise c.fail("variants", "is not 'replicated' followed by the sharded variants")
    graphs = report.get("graphs")  # absent or null in reports written before steps were replayed from graphs
    if graphs is not None:
        c.field(graphs, "mode", "graphs", str)
        c.field(graphs, "eager_reason", "graphs", str, none=True)
    sizing = c.field(report, "sizing", "", dict)
    for v in variants:
        sv = c.field(sizing, v, "sizing", dict)
        c.field(sv, "resident_bytes", f"sizing.{v}", lo=0, integer=True)
        c.field(sv, "reserve_bytes", f"sizing.{v}", lo=0, integer=True)
    rows = c.field(report, "rows_by_budget", "", list)
    if len(rows) != len(budgets) or not rows:
        raise c.fail("rows_by_budget", f"has {len(rows)} budgets, the field budgets {len(budgets)}")
    for b, row in enumerate(rows):
        w = f"rows_by_budget[{b}]"
        c.field(row, "budget_bytes", w, lo=0, above=True, integer=True)
        spec = c.field(row, "budget_spec", w, dict)
        if "kv_share" in spec:
            c.field(spec, "kv_share", f"{w}.budget_spec", lo=0.0, hi=1.0, above=True)
        elif "utilization" in spec:
            c.field(spec, "utilization", f"{w}.budget_spec", lo=0.0, hi=1.0, above=True)
            if c.field(spec, "memory_bytes", f"{w}.budget_spec", lo=1, integer=True, none=True) is None \
                    and report["device_memory_bytes"] is None:
                raise c.fail(f"{w}.budget_spec.memory_bytes", "is null and so is device_memory_bytes: the "
                                                             "utilization is of no memory")
        elif "bytes" in spec:
            c.field(spec, "bytes", f"{w}.budget_spec", lo=0, above=True, integer=True)
        else:
            raise c.fail(f"{w}.budget_spec", "names no budget (bytes, kv_share or utilization)")
        predicted = c.field(row, "predicted", w, dict)
        for v in variants:
            pv = c.field(row, v, w, dict)
            for key in ("pool_tokens", "pool_blocks", "pool_bytes"):
                c.field(pv, key, f"{w}.{v}", lo=1, integer=True)
            c.field(pv, "kv_share", f"{w}.{v}", lo=0.0, above=True)
            c.field(pv, "max_concurrency", f"{w}.{v}", lo=0, integer=True)
            if graphs is not None and graphs["eager_reason"] is None:  # read by the text beside each budget
                gv = c.field(pv, "graphs", f"{w}.{v}", dict)
                for key in ("graphed_steps", "eager_steps", "shapes"):
                    c.field(gv, key, f"{w}.{v}.graphs", lo=0, integer=True)
                c.field(gv, "capture_s", f"{w}.{v}.graphs", lo=0.0)
            c.field(c.field(predicted, v, f"{w}.predicted", dict), "pool_tokens", f"{w}.predicted.{v}", lo=0,
                    integer=True)
        points = c.field(row, "points", w, list)
        if len(points) != len(rates):
            raise c.fail(f"{w}.points", f"has {len(points)} points for {len(rates)} rates")
        for i, p in enumerate(points):
            pw = f"{w}.points[{i}]"
            if c.get(p, "rate", pw) != rates[i]:
                raise c.fail(f"{pw}.rate", f"is {str(p['rate'])[:20]}, the field rates[{i}] {rates[i]}")
            _check_point(c, p, pw, variants, slo is not None)
    differ = c.field(report, "differ", "", list)
    for i, d in enumerate(differ):
        dw = f"differ[{i}]"
        c.field(d, "rank", dw, lo=0, integer=True)
        c.field(d, "budget_bytes", dw, lo=0, above=True, integer=True)
        c.rate(c.get(d, "rate", dw), f"{dw}.rate")
        ids = c.field(d, "requests", dw, list)
        for j, rid in enumerate(ids):
            c.num(rid, f"{dw}.requests[{j}]", lo=0, integer=True)
    equal = c.field(report, "equal", "", bool)
    checked = c.field(report, "checked", "", bool)
    if equal and (differ or not checked):
        raise c.fail("equal", "says every token was equal, but " + (
            f"the field differ lists {len(differ)} runs whose tokens differ" if differ else "the tokens were not checked"))
    own = c.field(report, "own_schedule_differ", "", dict)
    c.field(own, "requests", "own_schedule_differ", lo=0, integer=True)
    c.field(own, "of", "own_schedule_differ", lo=0, integer=True)
    for i, lt in enumerate(c.field(report, "layer_times", "", list)):
        lw = f"layer_times[{i}]"
        c.field(lt, "tokens", lw, lo=1, integer=True)
        c.field(lt, "width", lw, lo=1, integer=True)
        measured = c.field(lt, "gather_us", lw, lo=0.0, none=True) is not None
        for key in ("compute_us", "predicted_hide_tokens"):  # read beside a gather measured
            c.field(lt, key, lw, lo=0.0, none=not measured)
        for key in ("predicted_gather_us", "predicted_compute_us"):
            c.field(lt, key, lw, lo=0.0)

