"""A prediction of what weight sharding buys, made without running a model: the package's own
:class:`~wsharding.serve.scheduler.Scheduler` replayed on a virtual clock, each step lasting what a
step-time profile says a step of its shape costs (Vidur's idea: measured per-operator times replayed
through the real scheduler to predict deployments not at hand).

The parts, in reading order:

* :class:`StepProfile` -- measured seconds per step shape (token bucket x context bucket) of each
  variant, per sharded layer its gather and compute, and the sizing (resident bytes, reserve, KV bytes
  per token). A shape the profile does not hold is refused, naming it (:class:`ProfileMissing`).
* :class:`StepModel` -- a step's seconds for a variant and a shape: the profile's own, or the
  replicated step plus the gathers as the schedule exposes them (:data:`RULES`), the gathers measured
  or priced by the cost model for N GPUs over a named link.
* :func:`replay` -- the Scheduler, per rank, on a virtual clock, the ranks run as
  :func:`~wsharding.serve.engine.serve` runs them: sharded ranks aligned (every rank joins every
  gather, so a step lasts as long as the slowest rank's; while some rank has work, an idle rank runs
  an idle step of one padding token, counted; while none has, none steps: they wait for the earliest
  arrival); replicated ranks free (an idle one waits for its next arrival, no step). A step's
  shape is :func:`~wsharding.serve.step.step_buckets`, a request's record the engine's
  :func:`~wsharding.serve.engine.record`.
* :func:`predict_pair` / :func:`pair_sweep` -- both variants on the same rescaled arrivals, judged as
  ``bench serve`` judges a point and a sweep: :func:`~wsharding.serve.metrics.pair_metrics` (goodput
  over the common window), :func:`~wsharding.serve.metrics.pair_steady`,
  :func:`~wsharding.serve.metrics.bracket` -- so "sustains X, fails at Y" means the same in both.
* :func:`predict_serve` -- per budget, each variant's pool (:func:`~wsharding.serve.budget.pool_blocks`
  of its resident bytes) and its bracketed sustained rate.
* :func:`compare_with_report` -- a prediction beside a measured ``bench serve`` report, with the error
  of each figure.

Everything this module returns is a prediction and says so: :data:`PREDICTED` is in every text line
and every JSON object it makes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from wsharding.core.errors import InvalidArgument, WshardingError
from wsharding.core.units import align_up
from wsharding.costmodel.plan import gather_seconds
from wsharding.serve.blocks import BLOCK_TOKENS, BlockPool
from wsharding.serve.budget import budget_for_share, pool_blocks
from wsharding.serve.engine import record
from wsharding.serve.metrics import SLO, bracket, bracket_json, bracket_text, pair_metrics, pair_steady, regime
from wsharding.serve.scheduler import Scheduler, check_servable
from wsharding.serve.step import context_buckets, step_buckets, token_buckets
from wsharding.serve.workload import Request, Workload

#: The label of every predicted figure, in text and JSON.
PREDICTED = "PREDICTED"
VARIANTS = ("replicated", "sharded")

#: How a sharded step's time is made from the profile:
#:
#: * ``measured`` -- the sharded model's own measured step of that shape: its gathers as they were
#:   exposed on the machine that measured (time-sliced, a link, CPU ranks), nothing modelled;
#: * ``serial`` -- the replicated step plus every sharded layer's gather: the gathers do not overlap
#:   compute, as on one GPU time-sliced by the ranks (a gather is a copy the GPU runs between the ranks'
#:   kernels, and the ranks' steps take turns);
#: * ``overlap`` -- over a real link with the lookahead of depth one: layer l+1's gather runs while
#:   layer l computes, so in a pipeline of alike layers each sharded layer costs
#:   ``max(compute, gather)`` and the unsharded part (layer 0, embedding, head) its own time: the
#:   replicated step plus ``sum_l max(0, gather_l - compute_l)``. (The pipeline's first gather, issued
#:   during the unsharded layer 0, is taken as hidden there like the others.)
RULES = ("measured", "serial", "overlap")


class ProfileMissing(InvalidArgument):
    """The step profile holds no time for a step shape the replay needs."""


class ProfileRefused(InvalidArgument):
    """Step times read from a report that does not hold them whole (a field missing, not a finite positive number)."""


def _key(tokens: int, context: int | None) -> str:
    return f"{tokens}x{'any' if context is None else context}"


@dataclass
class StepProfile:
    """Measured step times and what a prediction needs to size the pools.

    ``steps[variant][f"{tokens}x{context}"]``: seconds of one step of that token bucket attending over
    that context bucket (``"{tokens}xany"``: a time per token bucket over the contexts a run used, as a
    saved ``bench serve`` report holds it). ``layers``: per sharded layer and probed token count, its
    ``gather_s``, ``compute_s``, ``payload_bytes`` and ``layout_bytes`` (for ``ranks`` ranks).
    ``sizing``: ``resident_bytes`` per variant, ``reserve_bytes``, ``kv_bytes_per_token``.
    ``notes``: what the measuring machine was (emulation words) -- carried into every output."""

    source: str
    device: str
    ranks: int
    preset: str
    vocab: int
    token_budget: int
    max_context: int
    steps: dict[str, dict[str, float]]
    sizing: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def step_seconds(self, variant: str, tokens: int, context: int) -> float:
        """Seconds of one step of ``variant``; refuses a shape the profile does not hold, naming it."""
        table = self.steps.get(variant)
        if table is None:
            raise ProfileMissing(f"step profile ({self.source}): no {variant} steps at all; it holds "
                                 f"{sorted(self.steps)}")
        for key in (_key(tokens, context), _key(tokens, None)):
            if key in table:
                return table[key]
        held = sorted({k for k in table}, key=lambda k: (int(k.split("x")[0]), k))
        raise ProfileMissing(
            f"step profile ({self.source}): no {variant} step of {tokens} tokens x {context} context (token "
            f"bucket {tokens}, context bucket {context}); it holds {', '.join(held)}. Measure a profile with this "
            "token budget and context, or predict a workload within them")

    def layer_ids(self) -> list[int]:
        return sorted({lt["layer"] for lt in self.layers})

    def gathers(self) -> list[float]:
        """Per sharded layer, its measured gather (median over the probed shapes)."""
        out = []
        for layer in self.layer_ids():
            xs = [lt["gather_s"] for lt in self.layers if lt["layer"] == layer and lt.get("gather_s") is not None]
            if not xs:
                raise ProfileMissing(f"step profile ({self.source}): no measured gather of layer {layer}")
            out.append(statistics.median(xs))
        return out

    def layer_compute(self, tokens: int) -> list[float]:
        """Per sharded layer, its compute at ``tokens`` tokens: linear between the probed token counts,
        the nearest probe's beyond them."""
        out = []
        for layer in self.layer_ids():
            pts = sorted((lt["tokens"], lt["compute_s"]) for lt in self.layers
                         if lt["layer"] == layer and lt.get("compute_s") is not None)
            if not pts:
                raise ProfileMissing(f"step profile ({self.source}): no measured compute of layer {layer}")
            if tokens <= pts[0][0]:
                out.append(pts[0][1])
            elif tokens >= pts[-1][0]:
                out.append(pts[-1][1])
            else:
                for (a, ya), (b, yb) in zip(pts, pts[1:], strict=False):
                    if a <= tokens <= b:
                        out.append(ya + (yb - ya) * (tokens - a) / (b - a))
                        break
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "step profile", "source": self.source, "device": self.device, "ranks": self.ranks,
                "preset": self.preset, "vocab": self.vocab, "token_budget": self.token_budget,
                "max_context": self.max_context, "steps": self.steps, "sizing": self.sizing,
                "layers": self.layers, "notes": self.notes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepProfile:
        if d.get("kind") != "step profile":
            raise InvalidArgument("not a step profile (its 'kind' is not 'step profile'): give the JSON that "
                                  "wsharding plan --serve --profile measure wrote, or a bench serve report")
        fields = {k: v for k, v in d.items() if k != "kind"}
        try:
            return cls(**fields)
        except TypeError as e:
            raise InvalidArgument(f"step profile: {e} -- write it again with wsharding plan --serve --profile measure "
                                  "--json") from None

    @classmethod
    def from_serve_report(cls, report: dict[str, Any], source: str) -> StepProfile:
        """The profile a saved ``bench serve --json`` report holds: each variant's mean step time per
        token bucket over every point it ran (``"{tokens}xany"``: over the contexts it used), its layer
        times, its sizing."""
        acc: dict[str, dict[str, list[float]]] = {}
        for row in report["rows_by_budget"]:
            for p in row["points"]:
                for v in VARIANTS:
                    for k, c in p[v]["step_ms_by_bucket"].items():
                        a = acc.setdefault(v, {}).setdefault(_key(int(k), None), [0.0, 0])
                        a[0] += c["mean_ms"] * c["steps"] / 1e3
                        a[1] += c["steps"]
        steps = {v: {k: s / n for k, (s, n) in t.items()} for v, t in acc.items()}
        layers = [{"layer": lt["layer"], "tokens": lt["tokens"], "width": lt["width"],
                   "payload_bytes": lt["payload_bytes"], "layout_bytes": lt["layout_bytes"],
                   "gather_s": None if lt["gather_us"] is None else lt["gather_us"] / 1e6,
                   "compute_s": None if lt["compute_us"] is None else lt["compute_us"] / 1e6}
                  for lt in report.get("layer_times", [])]
        s = report["sizing"]
        sizing = {"resident_bytes": {v: s[v]["resident_bytes"] for v in VARIANTS},
                  "reserve_bytes": s["replicated"]["reserve_bytes"], "kv_bytes_per_token": report["kv_bytes_per_token"]}
        from wsharding.models import decoder_config

        return cls(source=source, device=report["device"], ranks=report["world_size"], preset=report["preset"],
                   vocab=decoder_config(report["preset"]).vocab, token_budget=report["token_budget"],
                   max_context=report["max_context"], steps=steps, sizing=sizing, layers=layers,
                   notes=list(report.get("notes", [])))


    @classmethod
    def from_old_report_steps(cls, report: Any, path: str) -> StepProfile:
        """The step times of a ``bench serve`` report of an earlier schema, and nothing else of it: its
        steps were measured, but its answer was not judged as a pair, so no figure of its answer is read.
        Only the fields a profile takes are read, each checked (present, of its type, finite and
        positive), a bad one refused in one line naming it; the profile says where it came from."""
        def bad(field: str, what: str) -> ProfileRefused:
            return ProfileRefused(f"--profile {path}: field {field} {what}; an old-format report gives step times "
                                  "only when they are whole: pass it unchanged, or run wsharding bench serve again")

        def get(obj: Any, key: str, field: str) -> Any:
            if not isinstance(obj, dict) or key not in obj:
                raise bad(field, "is missing")
            return obj[key]

        def num(obj: Any, key: str, field: str, *, integer: bool = False, zero: bool = False,
                none: bool = False) -> Any:
            x = get(obj, key, field)
            if x is None and none:
                return None
            if isinstance(x, bool) or not isinstance(x, int if integer else (int, float)):
                raise bad(field, f"is {str(x)[:30]!r}, {'a whole number' if integer else 'a number'} is needed")
            if not math.isfinite(x) or x < 0 or (x == 0 and not zero):
                raise bad(field, f"is {x}, a finite number {'>= 0' if zero else '> 0'} is needed")
            return x

        if not isinstance(report, dict) or report.get("bench") != "serve":
            raise ProfileRefused(f"--profile {path}: not a report of wsharding bench serve")
        for key in ("device", "preset"):
            if not isinstance(get(report, key, key), str):
                raise bad(key, "is not a string")
        ranks = num(report, "world_size", "world_size", integer=True)
        token_budget = num(report, "token_budget", "token_budget", integer=True)
        max_context = num(report, "max_context", "max_context", integer=True)
        per_token = num(report, "kv_bytes_per_token", "kv_bytes_per_token", integer=True)
        sizing = get(report, "sizing", "sizing")
        resident = {v: num(get(sizing, v, f"sizing.{v}"), "resident_bytes", f"sizing.{v}.resident_bytes", integer=True)
                    for v in VARIANTS}
        reserve = num(get(sizing, "replicated", "sizing.replicated"), "reserve_bytes",
                      "sizing.replicated.reserve_bytes", integer=True, zero=True)
        acc: dict[str, dict[str, list[float]]] = {}
        rows = get(report, "rows_by_budget", "rows_by_budget")
        for b, row in enumerate(rows if isinstance(rows, list) else []):
            points = get(row, "points", f"rows_by_budget[{b}].points")
            for i, p in enumerate(points if isinstance(points, list) else []):
                for v in VARIANTS:
                    w = f"rows_by_budget[{b}].points[{i}].{v}.step_ms_by_bucket"
                    table = get(get(p, v, f"rows_by_budget[{b}].points[{i}].{v}"), "step_ms_by_bucket", w)
                    if not isinstance(table, dict):
                        raise bad(w, "is not an object")
                    for k, c in table.items():
                        if not (isinstance(k, str) and k.isdigit() and int(k) >= 1):
                            raise bad(f"{w}.{str(k)[:20]}", "is not a token bucket (a whole number of tokens)")
                        a = acc.setdefault(v, {}).setdefault(_key(int(k), None), [0.0, 0])
                        n = num(c, "steps", f"{w}.{k}.steps", integer=True)
                        a[0] += num(c, "mean_ms", f"{w}.{k}.mean_ms") * n / 1e3
                        a[1] += n
        if set(acc) != set(VARIANTS):
            raise bad("rows_by_budget", "holds no step times of both variants")
        layers = []
        lts = report.get("layer_times", [])
        for i, lt in enumerate(lts if isinstance(lts, list) else []):
            w = f"layer_times[{i}]"
            layers.append({"layer": num(lt, "layer", f"{w}.layer", integer=True, zero=True),
                           "tokens": num(lt, "tokens", f"{w}.tokens", integer=True),
                           "width": num(lt, "width", f"{w}.width", integer=True),
                           "payload_bytes": num(lt, "payload_bytes", f"{w}.payload_bytes", integer=True),
                           "layout_bytes": num(lt, "layout_bytes", f"{w}.layout_bytes", integer=True),
                           **{f"{k}_s": None if (x := num(lt, f"{k}_us", f"{w}.{k}_us", zero=True, none=True)) is None
                              else x / 1e6 for k in ("gather", "compute")}})
        from wsharding.models import decoder_config

        try:
            vocab = decoder_config(report["preset"]).vocab
        except (KeyError, ValueError):
            raise bad("preset", f"is {report['preset'][:40]!r}, no decoder preset of this version") from None
        schema = report.get("schema")
        label = (f"steps of an old-format report ({'no schema' if schema is None else f'schema {schema}'}): its step "
                 "times only; its answer was not judged as a pair and is not read")
        return cls(source=f"{label}: {path}", device=report["device"], ranks=ranks, preset=report["preset"], vocab=vocab,
                   token_budget=token_budget, max_context=max_context,
                   steps={v: {k: s_ / n for k, (s_, n) in t.items()} for v, t in acc.items()},
                   sizing={"resident_bytes": resident, "reserve_bytes": reserve, "kv_bytes_per_token": per_token},
                   layers=layers, notes=[label])


@dataclass(frozen=True)
class StepModel:
    """A step's seconds per variant and shape: ``rule`` (:data:`RULES`) for the sharded variant; the
    gathers per sharded layer ``gathers_s`` (None: the profile's measured ones); ``link``: words for them."""

    profile: StepProfile
    rule: str = "measured"
    gathers_s: tuple[float, ...] | None = None
    link: str = "measured"
    #: Every measured compute time times this (a GPU not at hand: e.g. the ratio of two datasheet peaks).
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise InvalidArgument(f"rule: unknown {self.rule!r}; known: {', '.join(RULES)}")
        if not (self.compute_scale > 0 and math.isfinite(self.compute_scale)):
            raise InvalidArgument(f"compute scale: need a finite number > 0, got {self.compute_scale}")
        if self.rule == "measured" and self.compute_scale != 1.0:
            raise InvalidArgument("rule 'measured' takes the steps as measured, gathers included: a compute scale "
                                  "needs the rule 'overlap' or 'serial' (gathers apart)")
        if self.rule == "measured" and self.gathers_s is not None:
            raise InvalidArgument("rule 'measured' takes the sharded steps as measured: priced gathers need the "
                                  "rule 'overlap' (a link with lookahead) or 'serial'")

    def seconds(self, variant: str, tokens: int, context: int) -> float:
        rep = self.profile.step_seconds("replicated", tokens, context) * self.compute_scale
        if variant == "replicated":
            return rep
        if self.rule == "measured":
            return self.profile.step_seconds(variant, tokens, context)
        gathers = list(self.gathers_s) if self.gathers_s is not None else self.profile.gathers()
        if self.rule == "serial":
            return rep + sum(gathers)
        compute = [c * self.compute_scale for c in self.profile.layer_compute(tokens)]
        return rep + sum(max(0.0, g - c) for g, c in zip(gathers, compute, strict=True))

    def describe(self) -> str:
        scaled = "" if self.compute_scale == 1.0 else f"; measured compute x {self.compute_scale:g}"
        return {"measured": "each variant's steps as measured",
                "serial": f"the replicated steps plus every gather ({self.link}), in series (one time-sliced GPU)",
                "overlap": f"the replicated steps plus what of each gather ({self.link}) outlasts its layer's "
                           "compute (lookahead over a link)"}[self.rule] + scaled


def datasheet_gathers(profile: StepProfile, ranks: int, bandwidth: float, latency: float = 0.0) -> tuple[float, ...]:
    """Per sharded layer of ``profile``, its ring AllGather over ``ranks`` GPUs at ``bandwidth`` B/s
    (the cost model's :func:`~wsharding.costmodel.plan.gather_seconds`), its flat buffer padded for
    that group size (:func:`sharded_layout_bytes`)."""
    return tuple(gather_seconds(sharded_layout_bytes(b, ranks), ranks, bandwidth, latency)
                 for b in _payloads(profile))


def _payloads(profile: StepProfile) -> list[int]:
    by_layer = {lt["layer"]: lt["payload_bytes"] for lt in profile.layers}
    if not by_layer:
        raise ProfileMissing(f"step profile ({profile.source}): no sharded layers (their bytes price the gathers)")
    return [by_layer[k] for k in sorted(by_layer)]


def sharded_layout_bytes(payload_bytes: int, ranks: int) -> int:
    """A layer's flat buffer for ``ranks`` ranks: its payload rounded up to ``16 * ranks`` bytes (the
    layout's total rule; entries are 16-byte aligned, which the toy decoder's weights already are)."""
    return align_up(payload_bytes, 16 * ranks)


def sharded_resident_bytes(profile: StepProfile, ranks: int) -> int:
    """The sharded variant's resident bytes on ``ranks`` GPUs with plain slots: the replicated bytes less
    the sharded payload, plus each layer's chunk and two slots of the largest layer (the bill's formula)."""
    payloads = _payloads(profile)
    totals = [sharded_layout_bytes(b, ranks) for b in payloads]
    rep = profile.sizing["resident_bytes"]["replicated"]
    return rep - sum(payloads) + sum(t // ranks for t in totals) + 2 * max(totals)


# ---- the replay ---------------------------------------------------------------------------------------


class _CountedStorage:
    """What a :class:`BlockPool` needs of its storage to count blocks: its token rows. The replay moves
    no K/V, so none is allocated."""

    def __init__(self, blocks: int) -> None:
        self.tokens = (blocks + 1) * BLOCK_TOKENS - 1


def counted_pool(blocks: int) -> BlockPool:
    """A :class:`BlockPool` of ``blocks`` blocks that holds no K/V: the replay's pool."""
    if blocks < 1:
        raise InvalidArgument(f"a pool needs at least one block, got {blocks}")
    return BlockPool(_CountedStorage(blocks))  # type: ignore[arg-type]


class ReplayStalled(WshardingError, RuntimeError):
    """The replay ran ``max_steps`` steps and some rank still had work."""


@dataclass
class Replay:
    """A replay's per-request records (every rank's, in the engine's format) and its counts."""

    records: list[dict[str, Any]]
    steps: int
    idle_steps: int
    preemptions: int
    peak_blocks: int
    clock_s: float
    waited_for_memory: int = 0


def replay(requests: Sequence[list[Request]], blocks: int, seconds: Callable[[int, int], float], *, aligned: bool,
           token_budget: int, max_context: int, max_seqs: int | None = None, max_concurrency: int | None = None,
           max_steps: int = 2_000_000) -> Replay:
    """Serve every rank's ``requests`` with a pool of ``blocks`` blocks each on a virtual clock, a step
    of shape (tokens, context) (:func:`~wsharding.serve.step.step_buckets`) lasting ``seconds(tokens, context)``.

    As :func:`~wsharding.serve.engine.serve` runs them: a step is scheduled at the clock's time, its
    tokens reach the host when it ends, the next starts then. ``aligned`` (sharded ranks): before every
    step the clock moves on to when the earliest rank has something to compute
    (:meth:`~wsharding.serve.scheduler.Scheduler.ready_at`, the engine's agreement) -- while no rank
    has, none steps -- then every rank runs the step, a rank with nothing scheduled an idle step of one
    padding token, the step lasting the slowest rank's; the ranks stop together when none has work left.
    Otherwise (replicated, free) each rank runs on its own, waits for its next arrival with no step, and
    stops when its own work is done."""
    sizes, widths = token_buckets(token_budget), context_buckets(max_context)
    scheds = []
    for reqs in requests:
        pool = counted_pool(blocks)
        check_servable(reqs, pool, max_context)
        scheds.append(Scheduler(pool, reqs, token_budget=token_budget, max_seqs=max_seqs,
                                max_concurrency=max_concurrency))
    steps = idle = peak = 0
    end = 0.0
    if aligned:
        t = 0.0
        while (ready := min(s.ready_at() for s in scheds)) != math.inf:
            t = max(t, ready)  # no rank has anything to compute before then: every rank waits, no step
            plans = [s.schedule(t) for s in scheds]
            peak = max(peak, *(s.pool.used_blocks for s in scheds))
            if not any(plans):
                raise ReplayStalled(f"replay: no rank could schedule a step at {t:.6f} s with work left")
            t += max(seconds(*step_buckets(p, sizes, widths)) for p in plans)
            for s, p in zip(scheds, plans, strict=True):
                s.step_done(p, [0] * sum(x.samples for x in p), t)
            steps += 1
            idle += sum(not p for p in plans)
            if steps > max_steps:
                raise ReplayStalled(f"replay: still working after {max_steps} steps")
        end = t
    else:
        for s in scheds:
            t = 0.0
            while s.has_work():
                p = s.schedule(t)
                peak = max(peak, s.pool.used_blocks)
                if not p:
                    if not s.pending or s.pending[0].arrival_s <= t:
                        raise ReplayStalled(f"replay: a rank could schedule nothing at {t:.6f} s with work left")
                    t = s.pending[0].arrival_s
                    continue
                t += seconds(*step_buckets(p, sizes, widths))
                s.step_done(p, [0] * sum(x.samples for x in p), t)
                steps += 1
                if steps > max_steps:
                    raise ReplayStalled(f"replay: still working after {max_steps} steps")
            end = max(end, t)
    records = [record(q) for s in scheds for q in sorted(s.finished, key=lambda q: q.request.rid)]
    return Replay(records, steps, idle, sum(s.preemptions for s in scheds), peak, end,
                  sum(len(s.waited_for_memory) for s in scheds))


# ---- the prediction, judged as the bench judges a run ---------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """What a prediction serves: ``ranks`` ranks (one shard group), ``workload`` per rank, the step's
    ``token_budget``, the SLO, the trials per point (other seeds) and the requests left out as warm-up."""

    ranks: int
    workload: Workload
    token_budget: int
    slo: SLO
    vocab: int
    trials: int = 1
    warmup: int | None = None
    max_seqs: int | None = None
    max_concurrency: int | None = None

    @property
    def max_context(self) -> int:
        return context_buckets(self.workload.max_len)[-1]

    @property
    def warmup_requests(self) -> int:
        return self.workload.requests // 10 if self.warmup is None else self.warmup


Seconds = Callable[[int, int], float]


def predict_pair(setting: Setting, blocks: dict[str, int], seconds: dict[str, Seconds], rate: float) -> dict[str, Any]:
    """Both variants at one rate, judged as ``bench serve`` judges a point: per trial both replay the
    **same arrivals** (the workload's, rescaled to the rate; trial t's seed as the bench draws it),
    replicated ranks free and sharded ranks aligned, and :func:`~wsharding.serve.metrics.pair_metrics`
    judges them together (goodput over the arrival window common to both); the figures are means over
    trials, ``steady`` is :func:`~wsharding.serve.metrics.pair_steady` of those means, ``regime`` the
    replicated variant's (:func:`~wsharding.serve.metrics.regime`)."""
    per: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for t in range(setting.trials):
        wl = setting.workload.with_(rate=rate, seed=setting.workload.seed * 1000 + t)
        reqs = [wl.for_rank(r, setting.vocab) for r in range(setting.ranks)]
        runs = {v: replay(reqs, blocks[v], seconds[v], aligned=v != "replicated", token_budget=setting.token_budget,
                          max_context=setting.max_context, max_seqs=setting.max_seqs,
                          max_concurrency=setting.max_concurrency) for v in VARIANTS}
        pair = pair_metrics({v: runs[v].records for v in VARIANTS}, setting.ranks, setting.warmup_requests, setting.slo)
        for v in VARIANTS:
            rp = runs[v]
            pair[v].update(steps=rp.steps, idle_steps=rp.idle_steps, preemptions=rp.preemptions,
                           peak_blocks=rp.peak_blocks, waited_for_memory=rp.waited_for_memory)
            per[v].append(pair[v])
    mean = statistics.fmean
    label = None if math.isinf(rate) else rate
    out: dict[str, Any] = {"rate": label, "label": PREDICTED}
    for v in VARIANTS:
        ms = per[v]
        tpots = [m["tpot_ms"]["mean"] for m in ms if m["tpot_ms"]["mean"] is not None]
        out[v] = {"attainment": mean(m["attainment"] for m in ms), "goodput": mean(m["goodput"] for m in ms),
                  "goodput_own_window": mean(m["goodput_own_window"] for m in ms),
                  "request_throughput": mean(m["request_throughput"] for m in ms),
                  "ttft_ms_mean": mean(m["ttft_ms"]["mean"] for m in ms), "tpot_ms_mean": mean(tpots) if tpots else None,
                  "drain_share": mean(m["drain_share"] for m in ms),
                  **{k: mean(m[k] for m in ms) for k in ("preemptions", "waited_for_memory", "idle_steps")},
                  "peak_blocks": max(m["peak_blocks"] for m in ms), "label": PREDICTED}
    out["steady"] = pair_steady(label, {v: out[v]["drain_share"] for v in VARIANTS},
                                {v: out[v]["attainment"] for v in VARIANTS}, setting.slo.attainment)
    out["regime"] = regime(out["replicated"]["preemptions"], out["replicated"]["waited_for_memory"])
    return out


def pair_sweep(setting: Setting, blocks: dict[str, int], seconds: dict[str, Seconds], rates: Sequence[float], *,
               search: bool = True, refine: int = 3, widen: int = 8) -> dict[str, Any]:
    """Each variant's answer over a sweep of pairs (:func:`predict_pair`), as the bench answers:
    :func:`~wsharding.serve.metrics.bracket` over every rate replayed, each point's steadiness that of
    the pair. ``search``: beyond ``rates``, double above the highest while a variant passed every rate,
    halve below the lowest while one failed it (``widen`` times at most), then bisect between each
    variant's sustained and failing rate ``refine`` times -- every added rate replays both variants."""
    points: dict[float, dict[str, Any]] = {}
    target = setting.slo.attainment

    def at(rate: float) -> None:
        if rate not in points:
            points[rate] = predict_pair(setting, blocks, seconds, rate)

    def judge() -> dict[str, dict[str, Any]]:
        xs = sorted(points)
        steady = [points[x]["steady"] for x in xs]
        return {v: bracket(xs, [points[x][v]["attainment"] for x in xs], target, steady) for v in VARIANTS}

    for r in rates:
        at(float(r))
    got = judge()
    if search:
        for _ in range(widen):
            kinds = {b["kind"] for b in got.values()}
            hi, lo = max(points), min(points)
            grow = "at least" in kinds and math.isfinite(hi)
            shrink = "below the lowest" in kinds and math.isfinite(lo)
            if not (grow or shrink):
                break
            if grow:
                at(hi * 2)
            if shrink:
                at(lo / 2)
            got = judge()
        for _ in range(refine):
            added = False
            for b in got.values():
                if b["kind"] == "bracketed" and math.isfinite(b["fails_at"]):
                    # the geometric mean, to 3 significant digits: a rate a sweep could name
                    mid = float(f"{math.sqrt(b['sustained'] * b['fails_at']):.3g}")
                    if not b["sustained"] < mid < b["fails_at"]:
                        continue
                    added |= mid not in points
                    at(mid)
            if not added:
                break
            got = judge()
    return {"points": [points[x] for x in sorted(points)], "brackets": {v: {**bracket_json(b), "label": PREDICTED} for v, b in got.items()},
            "label": PREDICTED}


def rate_ratio(brackets: dict[str, dict[str, Any]]) -> float | None:
    """Sharded over replicated sustained rate where both are bracketed (a pass and a fail; None
    otherwise: an open side, "at least" or "not established", is no rate to divide)."""
    if any(brackets[v]["kind"] != "bracketed" for v in VARIANTS):
        return None
    return brackets["sharded"]["sustained"] / brackets["replicated"]["sustained"]


def budget_pools(profile: StepProfile, shares: Sequence[float], ranks: int | None = None) -> list[dict[str, Any]]:
    """Per KV share: the budget per rank (:func:`~wsharding.serve.budget.budget_for_share` of the
    replicated model) and each variant's pool blocks (:func:`~wsharding.serve.budget.pool_blocks` of its
    resident bytes; the sharded one's for ``ranks`` GPUs when they are not the profile's)."""
    s = profile.sizing
    resident = dict(s["resident_bytes"])
    if ranks is not None and ranks != profile.ranks:
        resident["sharded"] = sharded_resident_bytes(profile, ranks)
    out = []
    for share in shares:
        budget = budget_for_share(resident["replicated"], s["reserve_bytes"], share)
        blocks = {v: pool_blocks(budget, resident[v], s["reserve_bytes"], s["kv_bytes_per_token"]) for v in VARIANTS}
        out.append({"kv_share": share, "budget_bytes": budget, "resident_bytes": {v: resident[v] for v in VARIANTS},
                    "pool_blocks": blocks, "pool_tokens": {v: b * BLOCK_TOKENS for v, b in blocks.items()},
                    "pool_ratio": blocks["sharded"] / blocks["replicated"]})
    return out


def swept_text(workload: Workload) -> str:
    """The workload's words with its arrivals as a sweep replays them (at each rate, not its own)."""
    kind = "Poisson" if workload.burstiness == 1 else f"gamma (burstiness {workload.burstiness:g})"
    text = workload.with_(rate=math.inf).describe()
    return text.replace("arrivals all at once", f"{kind} arrivals rescaled to each rate replayed")


def predict_serve(profile: StepProfile, model: StepModel, setting: Setting, shares: Sequence[float],
                  rates: Sequence[float], *, search: bool = True, refine: int = 3,
                  pools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Each variant's predicted sustained rate per budget (a KV share of the replicated model's budget),
    bracketed and judged as a pair (:func:`pair_sweep`), with the pool ratio and the rate ratio.
    ``pools``: the budgets' pools when not the profile's (:func:`budget_pools`)."""
    pools = budget_pools(profile, shares, setting.ranks) if pools is None else pools
    seconds = {v: (lambda n, c, v=v: model.seconds(v, n, c)) for v in VARIANTS}
    rows = []
    for p in pools:
        row: dict[str, Any] = {**p, "label": PREDICTED,
                               **pair_sweep(setting, p["pool_blocks"], seconds, rates, search=search, refine=refine)}
        row["rate_ratio"] = rate_ratio(row["brackets"])
        rows.append(row)
    return {"label": PREDICTED, "kind": "serve prediction", "profile_source": profile.source,
            "profile_device": profile.device, "profile_notes": profile.notes, "preset": profile.preset,
            "ranks": setting.ranks, "rule": model.rule, "link": model.link, "step_model": model.describe(),
            "workload": setting.workload.as_dict(), "workload_text": swept_text(setting.workload),
            "token_budget": setting.token_budget, "trials": setting.trials, "warmup_requests": setting.warmup_requests,
            "slo": setting.slo.as_dict(), "slo_text": setting.slo.describe(), "rows_by_budget": rows}


def _rate(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:.3g}/s"


def format_prediction(pred: dict[str, Any]) -> str:
    """The prediction as text; every figure's line says PREDICTED."""
    lines = [f"{PREDICTED}: wsharding plan --serve -- {pred['preset']}, {pred['ranks']} ranks, not measured: the "
             "package's scheduler replayed on a virtual clock"]
    lines.append(f"  {PREDICTED} step times: {pred['step_model']}; profile: {pred['profile_source']} "
                 f"({pred['profile_device']}); replicated ranks free, sharded ranks aligned (idle steps counted); "
                 "judged as a pair as bench serve judges: the same arrivals, goodput over their common window")
    lines += [f"  NOTE (profile): {n}" for n in pred["profile_notes"]]
    if pred["rule"] != "measured" and any("time-slice" in n for n in pred["profile_notes"]):
        lines.append("  NOTE: the profile's compute was measured with the ranks taking turns on one GPU, so each "
                     "step holds the other ranks' work too: on one GPU per rank it would be shorter "
                     "(--compute-scale, e.g. 1/ranks per GPU, an estimate)")
    lines.append(f"  workload: {pred['workload_text']}; {pred['trials']} trial(s), the first "
                 f"{pred['warmup_requests']} requests per rank left out; SLO: {pred['slo_text']}")
    for row in pred["rows_by_budget"]:
        lines.append(f"  {PREDICTED} budget {row['budget_bytes'] / 2**20:,.2f} MiB per rank (replicated KV share "
                     f"{row['kv_share']:.0%}): KV pool replicated {row['pool_tokens']['replicated']:,} tokens, sharded "
                     f"{row['pool_tokens']['sharded']:,} (pool ratio {row['pool_ratio']:.2f}x)")
        for p in row["points"]:
            met = ", ".join(f"{v} {p[v]['attainment']:.0%} (goodput {p[v]['goodput']:.2f}/s)" for v in VARIANTS)
            lines.append(f"    {PREDICTED} rate {_rate(p['rate'])}: met the SLO {met}; {p['regime']}"
                         + ("" if p["steady"] else "; not a steady state"))
        for v in VARIANTS:
            lines.append(f"    {PREDICTED} {v:<10} {bracket_text(row['brackets'][v])}")
        ratio = row["rate_ratio"]
        lines.append(f"    {PREDICTED} sustained-rate ratio sharded/replicated: "
                     f"{'- (not both bracketed)' if ratio is None else f'{ratio:.2f}x'} (pool ratio {row['pool_ratio']:.2f}x)")
    return "\n".join(lines)


# ---- a prediction beside a measurement -------------------------------------------------------------------


def _err(pred: float | None, meas: float | None) -> float | None:
    return None if pred is None or not meas else (pred - meas) / meas


def compare_with_report(pred: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """A prediction beside the measured ``bench serve`` report (schema 3, read by ``read_serve_report``)
    it predicts -- same budgets, same rates: per budget and variant the bracket, predicted and measured,
    and the error of the sustained rate; per rate the attainment, the goodput over the common window,
    the TTFT and TPOT means, each with its relative error ``(predicted - measured) / measured``, and
    whether the pair's point was steady in each."""
    if len(pred["rows_by_budget"]) != len(report["rows_by_budget"]):
        raise InvalidArgument(f"compare: the prediction has {len(pred['rows_by_budget'])} budgets, the report "
                              f"{len(report['rows_by_budget'])}: predict the report's budgets")
    rows = []
    for prow, mrow in zip(pred["rows_by_budget"], report["rows_by_budget"], strict=True):
        out: dict[str, Any] = {"budget_bytes": mrow["budget_bytes"], "predicted_budget_bytes": prow["budget_bytes"],
                               "label": PREDICTED, "points": []}
        by_rate = {p["rate"]: p for p in prow["points"]}
        brackets = mrow["answer"]["brackets"]
        for i, mp in enumerate(mrow["points"]):
            pp = by_rate.get(mp["rate"])
            if pp is None:
                continue
            item: dict[str, Any] = {"rate": mp["rate"], "steady_predicted": pp["steady"],
                                    "steady_measured": mrow["answer"]["steady"][i],
                                    "regime_predicted": pp["regime"], "regime_measured": mrow["answer"]["regime"][i]}
            for v in VARIANTS:
                x = mp[v]
                meas = {"attainment": x["attainment"]["mean"], "goodput": x["goodput"]["mean"],
                        "ttft_ms_mean": x["ttft_ms"]["mean"]["mean"], "tpot_ms_mean": x["tpot_ms"]["mean"]["mean"]}
                item[v] = {**{f"{k}_predicted": pp[v][k] for k in meas}, **{f"{k}_measured": m for k, m in meas.items()},
                           **{f"{k}_error": _err(pp[v][k], m) for k, m in meas.items()}}
            out["points"].append(item)
        for v in VARIANTS:
            pb, mb = prow["brackets"][v], brackets[v]
            out[v] = {"predicted": pb, "measured": mb, "predicted_text": bracket_text(pb),
                      "measured_text": bracket_text(mb), "sustained_predicted": pb["sustained"],
                      "sustained_measured": mb["sustained"], "sustained_error": _err(pb["sustained"], mb["sustained"]),
                      "fails_at_predicted": pb["fails_at"], "fails_at_measured": mb["fails_at"],
                      "same_bracket": (pb["kind"], pb["sustained"], pb["fails_at"]) == (mb["kind"], mb["sustained"],
                                                                                       mb["fails_at"])}
        rows.append(out)
    return {"label": PREDICTED, "kind": "prediction vs measurement", "measured_notes": report.get("notes", []),
            "rows_by_budget": rows}


def report_pools(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per budget of a ``bench serve`` report, the pools its run served with (its own blocks per
    variant, whatever named its budget: bytes, a KV share or a utilization)."""
    out = []
    for row in report["rows_by_budget"]:
        blocks = {v: row[v]["pool_blocks"] for v in VARIANTS}
        out.append({"kv_share": row["replicated"]["kv_share"], "budget_bytes": row["budget_bytes"],
                    "resident_bytes": {v: report["sizing"][v]["resident_bytes"] for v in VARIANTS},
                    "pool_blocks": blocks, "pool_tokens": {v: b * BLOCK_TOKENS for v, b in blocks.items()},
                    "pool_ratio": blocks["sharded"] / blocks["replicated"]})
    return out


def predict_report(profile: StepProfile, model: StepModel, report: dict[str, Any]) -> dict[str, Any]:
    """The prediction of a saved ``bench serve`` run (schema 3) -- its workload, pools, rates, trials,
    warm-up, SLO, step sizes and ranks -- with :func:`compare_with_report` beside it (``"comparison"``):
    what ``bench serve --predict`` prints under its own answer. A run of a trace's lengths is refused
    (its report does not keep the trace's pairs, so its requests cannot be drawn again)."""
    if report.get("slo") is None:
        raise InvalidArgument("predict a bench serve run: it was run without an SLO, so it has no sustained rate")
    if report["workload"].get("source", "random") != "random":
        raise InvalidArgument(f"predict a bench serve run: its lengths came from {report['workload']['source']}, "
                              "whose pairs the report does not keep; predict a run of uniform lengths")
    missing = [v for v in VARIANTS if v not in report["variants"]]
    if missing:
        raise InvalidArgument(f"predict a bench serve run: it has no {', '.join(missing)} variant")
    setting = Setting(ranks=report["world_size"], workload=Workload.from_dict(report["workload"]),
                      token_budget=report["token_budget"], slo=SLO(**report["slo"]), vocab=profile.vocab,
                      trials=report["trials"], warmup=report["warmup_requests"], max_seqs=report.get("max_seqs"),
                      max_concurrency=report.get("max_concurrency"))
    if setting.max_context != report["max_context"]:
        raise InvalidArgument(f"predict a bench serve run: its steps attended over {report['max_context']} tokens, "
                              f"its workload's requests need {setting.max_context}: not a report of this version")
    rates = [math.inf if r is None else r for r in report["rates"]]
    pred = predict_serve(profile, model, setting, [], rates, search=False, pools=report_pools(report))
    pred["comparison"] = compare_with_report(pred, report)
    return pred


def format_comparison(cmp: dict[str, Any]) -> str:
    """The comparison as text, predicted beside measured with the error of each."""
    def pct(e: float | None) -> str:
        return "-" if e is None else f"{e:+.0%}"

    def num(x: float | None, fmt: str = ".2f") -> str:
        return "-" if x is None else f"{x:{fmt}}"

    lines = [f"{PREDICTED} vs measured (bench serve report, both judged as a pair; the error is "
             "(predicted - measured) / measured):"]
    lines += [f"  NOTE (measured): {n}" for n in cmp["measured_notes"]]
    for row in cmp["rows_by_budget"]:
        lines.append(f"  budget {row['budget_bytes'] / 2**20:,.2f} MiB per rank:")
        for v in VARIANTS:
            x = row[v]
            lines.append(f"    {v:<10} {PREDICTED} {x['predicted_text']}; measured {x['measured_text']}; sustained "
                         f"rate error {pct(x['sustained_error'])}")
        for p in row["points"]:
            steady = {True: "steady", False: "not steady"}
            lines.append(f"    rate {_rate(p['rate'])}: {PREDICTED} {steady[p['steady_predicted']]}, {p['regime_predicted']}"
                         f"; measured {steady[p['steady_measured']]}, {p['regime_measured']}")
            for v in VARIANTS:
                q = p[v]
                lines.append(f"      {v:<10} met the SLO {num(q['attainment_predicted'], '.0%')} vs "
                             f"{num(q['attainment_measured'], '.0%')}, goodput {num(q['goodput_predicted'])} vs "
                             f"{num(q['goodput_measured'])} ({pct(q['goodput_error'])}), TTFT mean "
                             f"{num(q['ttft_ms_mean_predicted'], '.1f')} vs {num(q['ttft_ms_mean_measured'], '.1f')} ms "
                             f"({pct(q['ttft_ms_mean_error'])}), TPOT mean {num(q['tpot_ms_mean_predicted'], '.1f')} vs "
                             f"{num(q['tpot_ms_mean_measured'], '.1f')} ms ({pct(q['tpot_ms_mean_error'])})")
    return "\n".join(lines)


# ---- the design's deployment: Kimi K3 on 8 B200s, from the cost model alone ----------------------------

#: The deployment the design starts from, and the workload its line replays (a stated choice: long
#: enough prompts that a step is full, few enough requests that the replay of 8 ranks stays quick).
DESIGN_PRESET, DESIGN_RANKS, DESIGN_DEVICE = "kimi-k3-b200-fp8", 8, "b200"
DESIGN_WORKLOAD = Workload(requests=40, prompt=(1024, 2048), output=(128, 256))


def design_prediction(slo: SLO, *, efficiency: float = 1.0, rates: Sequence[float] = (1.0,),
                      workload: Workload = DESIGN_WORKLOAD, refine: int = 2, widen: int = 8) -> dict[str, Any]:
    """Each variant's sustained rate for :data:`DESIGN_PRESET` on :data:`DESIGN_RANKS`
    :data:`DESIGN_DEVICE` GPUs, from the cost model alone (nothing of it was measured): the pools are
    the preset's replicated KV pool and that pool plus the net saving (``Plan.kv_capacity``); a
    replicated step is the roofline of the sharded GEMMs (``2 * params * tokens / (peak * efficiency)``
    per layer, attention and routed experts not modelled: a lower bound, so the gathers show as much as
    they can -- the case least favourable to sharding); a sharded step adds what of each layer's
    gather over the B200's NVLink outlasts its compute (the ``overlap`` rule)."""
    from wsharding.costmodel import Deployment, estimate, get_device
    from wsharding.presets import load_preset

    plan = estimate(load_preset(DESIGN_PRESET), Deployment(ranks=DESIGN_RANKS, device=get_device(DESIGN_DEVICE),
                                                           tokens=256, efficiency=efficiency))
    cap = plan.kv_capacity()
    kv = plan.kv_bytes_per_token
    per_token = [c.compute_seconds_per_token for c in plan.layers]
    gathers = [c.gather_seconds for c in plan.layers]

    def seconds(variant: str, tokens: int, context: int) -> float:
        compute = [p * tokens for p in per_token]
        rep = sum(compute)
        return rep if variant == "replicated" else rep + sum(max(0.0, g - c) for g, c in zip(gathers, compute, strict=True))

    token_budget = int(plan.deployment.tokens)
    blocks = {"replicated": cap["pool_bytes_replicated"] // (BLOCK_TOKENS * kv) - 1,
              "sharded": cap["pool_bytes_sharded"] // (BLOCK_TOKENS * kv) - 1}
    setting = Setting(ranks=DESIGN_RANKS, workload=workload, token_budget=token_budget, slo=slo, vocab=32768)
    out: dict[str, Any] = {"label": PREDICTED, "preset": DESIGN_PRESET, "ranks": DESIGN_RANKS, "device": DESIGN_DEVICE,
                           "efficiency": efficiency, "token_budget": token_budget, "workload_text": swept_text(workload),
                           "pool_tokens": {v: b * BLOCK_TOKENS for v, b in blocks.items()},
                           "pool_ratio": blocks["sharded"] / blocks["replicated"],
                           "step_s_full": {v: seconds(v, token_budget, 0) for v in VARIANTS},
                           "breakeven_tokens": plan.breakeven_tokens}
    out["step_ratio_full"] = out["step_s_full"]["sharded"] / out["step_s_full"]["replicated"]
    out.update(pair_sweep(setting, blocks, {v: (lambda n, c, v=v: seconds(v, n, c)) for v in VARIANTS}, rates,
                          refine=refine, widen=widen))
    out["rate_ratio"] = rate_ratio(out["brackets"])
    return out


def design_text(d: dict[str, Any]) -> str:
    """The design's line, labelled PREDICTED."""
    ratio = "-" if d["rate_ratio"] is None else f"{d['rate_ratio']:.2f}x"
    return (f"  {PREDICTED}, not measured ({d['preset']} on {d['ranks']} x {d['device'].upper()}, cost model only: "
            f"compute = roofline of the sharded GEMMs at {d['efficiency']:.0%} of peak, a lower bound, so the case "
            f"least favourable to sharding; gathers over NVLink with lookahead): KV pool {d['pool_tokens']['replicated']:,} -> {d['pool_tokens']['sharded']:,} "
            f"tokens per GPU ({d['pool_ratio']:.2f}x); a {d['token_budget']}-token step "
            f"{1e3 * d['step_s_full']['replicated']:.2f} -> {1e3 * d['step_s_full']['sharded']:.2f} ms "
            f"({d['step_ratio_full']:.2f}x; the gathers hide from {d['breakeven_tokens']:,} tokens per step); "
            f"sustained rate per GPU replicated {bracket_text(d['brackets']['replicated'])}, sharded "
            f"{bracket_text(d['brackets']['sharded'])}: "
            f"{ratio} ({d['workload_text']})")
