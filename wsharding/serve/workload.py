"""A seeded stream of requests: prompt and output lengths from a stated distribution, arrival times.

Every rank draws its own requests (DP attention: each rank serves its own users), from a generator
seeded by the workload's seed and the rank, so a run can be repeated and two variants of the model
get exactly the same requests.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from wsharding.core.errors import InvalidArgument


@dataclass(frozen=True)
class Request:
    """One request of one rank: ``prompt`` token ids, ``output`` tokens to generate, arrival in seconds
    after the run's start."""

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
    ``output``; arrivals Poisson at ``rate`` requests per second per rank, or all at time 0 when
    ``rate`` is infinite (the default)."""

    requests: int = 32
    prompt: tuple[int, int] = (8, 32)
    output: tuple[int, int] = (8, 32)
    rate: float = math.inf
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise InvalidArgument(f"requests: need at least 1, got {self.requests}")
        for name in ("prompt", "output"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise InvalidArgument(f"{name} lengths: need 1 <= low <= high, got {lo}..{hi}")
        if not self.rate > 0:
            raise InvalidArgument(f"rate: requests per second must be > 0 (inf: all at once), got {self.rate}")

    @property
    def max_len(self) -> int:
        """The longest KV footprint a request of this workload can have (the width of a step's attention)."""
        return self.prompt[1] + self.output[1] - 1

    def describe(self) -> str:
        arrivals = "all at once" if math.isinf(self.rate) else f"Poisson, {self.rate:g} requests/s per rank"
        return (f"{self.requests} requests per rank, prompt {self.prompt[0]}..{self.prompt[1]} tokens, "
                f"output {self.output[0]}..{self.output[1]} tokens (uniform), arrivals {arrivals}, seed {self.seed}")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate"] = None if math.isinf(self.rate) else self.rate
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        """The inverse of :meth:`as_dict` (a rate of None is all at once; JSON lists become ranges)."""
        d = dict(d)
        d["rate"] = math.inf if d.get("rate") is None else d["rate"]
        for key in ("prompt", "output"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)

    def for_rank(self, rank: int, vocab: int) -> list[Request]:
        """This rank's requests, in arrival order."""
        g = torch.Generator().manual_seed(1_000_003 * self.seed + 7919 * rank + 17)
        t, out = 0.0, []
        for i in range(self.requests):
            if not math.isinf(self.rate):
                t += float(-math.log(1.0 - torch.rand((), generator=g).item()) / self.rate)
            p = int(torch.randint(self.prompt[0], self.prompt[1] + 1, (), generator=g))
            o = int(torch.randint(self.output[0], self.output[1] + 1, (), generator=g))
            prompt = tuple(torch.randint(0, vocab, (p,), generator=g).tolist())
            out.append(Request(rid=i, rank=rank, arrival_s=t, prompt=prompt, output=o))
        return out
