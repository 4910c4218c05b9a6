"""A seeded stream of requests: prompt and output lengths, arrival times.

Every rank draws its own requests (DP attention: each rank serves its own users), from a generator
seeded by the workload's seed and the rank, so a run can be repeated and two variants of the model
get exactly the same requests. Lengths come from uniform ranges (the default) or from a list of
(prompt, output) pairs -- a real trace such as ShareGPT (:mod:`wsharding.serve.sharegpt`), drawn
with replacement. Arrivals follow vLLM's ``benchmark_serving``: gaps drawn from a gamma distribution
of shape ``burstiness`` and mean ``1 / rate`` (burstiness 1 is a Poisson process; below 1, burstier),
or all at time 0 when the rate is infinite. The drawn times are then **rescaled** so that the
realised rate -- requests over the time to the last arrival (:func:`realised_rate`) -- equals the
label exactly, as vLLM's ``bench serve`` does: a few drawn gaps would otherwise offer another rate
than the one reported (2.80/s at a label of 3/s).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from wsharding.core.errors import InvalidArgument


@dataclass(frozen=True)
class Request:
    """One request of one rank: ``prompt`` token ids, ``output`` tokens to generate, arrival in seconds
    after the run's start. The output length is the user's (the request stops there, as at an end of
    sequence token): the scheduler never reads it."""

    rid: int
    rank: int
    arrival_s: float
    prompt: tuple[int, ...]
    output: int

    @property
    def kv_tokens(self) -> int:
        """Tokens this request writes into the KV cache: the prompt and every generated token but the
        last (which is returned, never fed back)."""
        return len(self.prompt) + self.output - 1


@dataclass(frozen=True)
class Workload:
    """``requests`` per rank; prompt and output lengths uniform on the closed ranges ``prompt`` and
    ``output``, or drawn from ``lengths`` (pairs of a trace, named ``source``) when given; arrivals at
    ``rate`` requests per second per rank (gamma gaps of shape ``burstiness``), or all at time 0 when
    ``rate`` is infinite (the default). ``seed`` seeds lengths, tokens and arrivals."""

    requests: int = 32
    prompt: tuple[int, int] = (8, 32)
    output: tuple[int, int] = (8, 32)
    rate: float = math.inf
    seed: int = 0
    burstiness: float = 1.0
    lengths: tuple[tuple[int, int], ...] | None = None
    source: str = "random"

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise InvalidArgument(f"requests: need at least 1, got {self.requests}")
        for name in ("prompt", "output"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise InvalidArgument(f"{name} lengths: need 1 <= low <= high, got {lo}..{hi}")
        if not self.rate > 0:
            raise InvalidArgument(f"rate: requests per second must be > 0 (inf: all at once), got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise InvalidArgument(f"burstiness: must be a finite number > 0 (1: Poisson), got {self.burstiness}")
        if self.lengths is not None:
            if not self.lengths or any(p < 1 or o < 1 for p, o in self.lengths):
                raise InvalidArgument(f"lengths of {self.source}: need (prompt >= 1, output >= 1) pairs")
            # the ranges then describe the trace, so max_len and the text hold for it too
            ps, os_ = [p for p, _ in self.lengths], [o for _, o in self.lengths]
            object.__setattr__(self, "prompt", (min(ps), max(ps)))
            object.__setattr__(self, "output", (min(os_), max(os_)))

    @property
    def max_len(self) -> int:
        """The longest KV footprint a request of this workload can have (of a trace: its longest pair,
        not its longest prompt plus its longest output)."""
        if self.lengths is not None:
            return max(p + o for p, o in self.lengths) - 1
        return self.prompt[1] + self.output[1] - 1

    def with_(self, **changes: Any) -> Workload:
        """A copy with ``changes`` (a rate, a seed of another trial)."""
        return replace(self, **changes)

    def describe(self) -> str:
        if math.isinf(self.rate):
            arrivals = "all at once"
        else:
            kind = "Poisson" if self.burstiness == 1 else f"gamma gaps, burstiness {self.burstiness:g}"
            arrivals = f"{kind}, {self.rate:g} requests/s per rank"
        if self.lengths is not None:
            dist = f"lengths from {self.source} ({len(self.lengths):,} pairs; prompt {self.prompt[0]}..{self.prompt[1]}, " \
                   f"output {self.output[0]}..{self.output[1]} tokens)"
        else:
            dist = f"prompt {self.prompt[0]}..{self.prompt[1]} tokens, output {self.output[0]}..{self.output[1]} " \
                   "tokens (uniform)"
        return f"{self.requests} requests per rank, {dist}, arrivals {arrivals}, seed {self.seed}"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate"] = None if math.isinf(self.rate) else self.rate
        if self.lengths is not None:
            d["lengths"] = [list(x) for x in self.lengths]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        """The inverse of :meth:`as_dict` (a rate of None is all at once; JSON lists become tuples)."""
        d = dict(d)
        d["rate"] = math.inf if d.get("rate") is None else d["rate"]
        for key in ("prompt", "output"):
            if key in d:
                d[key] = tuple(d[key])
        if d.get("lengths") is not None:
            d["lengths"] = tuple(tuple(x) for x in d["lengths"])
        return cls(**d)

    def for_rank(self, rank: int, vocab: int) -> list[Request]:
        """This rank's requests, in arrival order, their arrivals rescaled to the rate exactly
        (:func:`realised_rate` is ``rate``)."""
        g = torch.Generator().manual_seed(1_000_003 * self.seed + 7919 * rank + 17)
        t, out = 0.0, []
        for i in range(self.requests):
            if not math.isinf(self.rate):
                # gamma(shape k, scale 1/(k rate)): mean gap 1/rate whatever k (k = 1: exponential)
                t += _gamma(self.burstiness, self.burstiness * self.rate, g)
            if self.lengths is not None:
                p, o = self.lengths[int(torch.randint(len(self.lengths), (), generator=g))]
            else:
                p = int(torch.randint(self.prompt[0], self.prompt[1] + 1, (), generator=g))
                o = int(torch.randint(self.output[0], self.output[1] + 1, (), generator=g))
            prompt = tuple(torch.randint(0, vocab, (p,), generator=g).tolist())
            out.append(Request(rid=i, rank=rank, arrival_s=t, prompt=prompt, output=o))
        if not math.isinf(self.rate) and t > 0:
            scale = self.requests / self.rate / t  # the last arrival at requests / rate
            out = [replace(r, arrival_s=r.arrival_s * scale) for r in out]
            out[-1] = replace(out[-1], arrival_s=self.requests / self.rate)
        return out


def realised_rate(requests: list[Request]) -> float | None:
    """Requests per second these requests offer: their count over the time to the last arrival
    (None when all arrive at once)."""
    last = max((r.arrival_s for r in requests), default=0.0)
    return len(requests) / last if last > 0 else None


def _gamma(k: float, rate: float, g: torch.Generator) -> float:
    """One draw of gamma(shape ``k``, rate ``rate``) from ``g`` (torch's distributions take no
    generator): the exponential by its inverse CDF, other shapes by Marsaglia and Tsang's method."""
    if k == 1.0:
        return -math.log(1.0 - torch.rand((), generator=g).item()) / rate
    boost = 1.0
    if k < 1.0:  # gamma(k) = gamma(k + 1) * U^(1/k)
        boost = torch.rand((), generator=g).item() ** (1.0 / k)
        k += 1.0
    d = k - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    while True:
        x = torch.randn((), generator=g).item()
        v = (1.0 + c * x) ** 3
        if v <= 0:
            continue
        u = torch.rand((), generator=g).item()
        if math.log(max(u, 1e-300)) < 0.5 * x * x + d - d * v + d * math.log(v):
            return boost * d * v / rate
