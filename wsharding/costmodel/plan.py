"""Where the model runs, what each layer's gather costs in time, and the whole plan.

The timing model: a ring AllGather moves ``(N-1)/N * |T_l|`` bytes per rank per layer, whatever the
batch, and the gather of layer ``l+1`` runs while layer ``l`` computes. Layer ``l``'s compute is
modelled as the GEMMs of its sharded weights only, ``2 * tokens * params / (peak * efficiency)``: a
*lower bound* on the layer's time, so the break-even batch is a conservative one. The memory side
is :func:`~wsharding.costmodel.bill.bill_for_layouts`; :func:`estimate` puts the two together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from wsharding.core.layout import SUPPORTED_DTYPES
from wsharding.costmodel.bill import Bill, bill_for_layouts
from wsharding.costmodel.checks import CostModelError, require_int
from wsharding.costmodel.devices import MAPPED_PAGE_BYTES, Device
from wsharding.costmodel.spec import LayerSpec, ModelSpec


@dataclass(frozen=True)
class Deployment:
    """Where the model runs: shard group size, link bandwidth, device peaks, tokens per step.

    ``link_bandwidth`` (bytes/s) defaults to the device's per-direction NVLink bandwidth;
    ``efficiency`` scales the peak FLOP/s (1.0 = datasheet peak); ``collective_latency`` (s) is a
    fixed cost added to every gather (launch and synchronisation); ``context`` (tokens per request)
    turns extra KV tokens into extra concurrent requests.
    """

    ranks: int
    device: Device
    tokens: int
    link_bandwidth: float | None = None
    efficiency: float = 1.0
    collective_latency: float = 0.0
    kv_bytes_per_token: int | None = None
    context: int | None = None
    #: The KV-cache pool per GPU when the weights are replicated (bytes): what the memory left after
    #: every weight and the activations holds. Sharding adds its net saving to it.
    kv_pool_bytes: int | None = None
    #: Layers gather into views mapped over their chunks (``WeightSharding(map_own_chunk=True)``):
    #: chunks padded to :data:`MAPPED_PAGE_BYTES`, slots (N-1)/N after finalize.
    map_own_chunk: bool = False

    def __post_init__(self) -> None:
        require_int(self.ranks, "ranks", minimum=1)
        require_int(self.tokens, "tokens", minimum=0)
        if self.link_bandwidth is not None and not (self.link_bandwidth > 0 and math.isfinite(self.link_bandwidth)):
            raise CostModelError(f"bandwidth: must be a positive number of bytes/s, got {self.link_bandwidth!r}")
        if not 0 < self.efficiency <= 1:
            raise CostModelError(f"efficiency: must be in (0, 1], got {self.efficiency!r}")
        if not self.collective_latency >= 0:
            raise CostModelError(f"latency: must be >= 0 seconds, got {self.collective_latency!r}")
        if self.kv_bytes_per_token is not None:
            require_int(self.kv_bytes_per_token, "kv_bytes_per_token", minimum=1)
        if self.context is not None:
            require_int(self.context, "context", minimum=1)
        if self.kv_pool_bytes is not None:
            require_int(self.kv_pool_bytes, "kv_pool_bytes", minimum=0)

    @property
    def bandwidth(self) -> float:
        return self.device.link_bandwidth if self.link_bandwidth is None else self.link_bandwidth


@dataclass(frozen=True)
class LayerCost:
    """Traffic and time of one sharded layer (``hide_*`` fields: its gather hidden behind the
    previous sharded layer's compute; ``None`` for the first, whose gather is issued up front)."""

    index: int
    kind: str
    payload_bytes: int
    layout_bytes: int
    gather_bytes_per_rank: int
    gather_seconds: float
    params: int
    compute_seconds_per_token: float
    compute_seconds: float
    hide_ratio: float | None
    breakeven_tokens: int | None


def gather_seconds(layout_bytes: int, ranks: int, bandwidth: float, latency: float = 0.0) -> float:
    """Ring AllGather time: each rank receives ``(N-1)/N * |T|`` bytes at ``bandwidth`` B/s.
    With N = 1 there is no collective at all."""
    if ranks == 1:
        return 0.0
    return latency + (ranks - 1) * (layout_bytes // ranks) / bandwidth


def compute_seconds_per_token(layer: LayerSpec, device: Device, efficiency: float) -> float:
    """Seconds per token of layer ``layer``'s sharded GEMMs: 2 FLOPs per parameter per token."""
    return sum(2 * g.params / (device.peak_for(g.dtype) * efficiency) for g in layer.groups)


def breakeven(gather: float, per_token: float) -> int:
    """Smallest whole number of tokens T >= 0 with ``T * per_token >= gather``."""
    if gather <= 0:
        return 0
    t = max(0, math.ceil(gather / per_token))
    # ceil of a float quotient can be off by one either way; settle on the exact boundary.
    while t > 0 and (t - 1) * per_token >= gather:
        t -= 1
    while t * per_token < gather:
        t += 1
    return t


@dataclass(frozen=True)
class Plan:
    """The whole bill of one model on one deployment: memory, per-layer traffic and time, KV."""

    model: ModelSpec
    deployment: Deployment
    bill: Bill
    layers: tuple[LayerCost, ...]
    groups: tuple[tuple[str, torch.dtype, int], ...]

    @property
    def largest(self) -> LayerCost:
        return max(self.layers, key=lambda c: c.layout_bytes)

    @property
    def breakeven_tokens(self) -> int | None:
        """Tokens per step from which every gather hides behind the previous layer's compute."""
        values = [c.breakeven_tokens for c in self.layers if c.breakeven_tokens is not None]
        return max(values) if values else None

    @property
    def worst_pair(self) -> LayerCost | None:
        """The layer whose gather is hardest to hide (largest break-even)."""
        cands = [c for c in self.layers if c.breakeven_tokens is not None]
        return max(cands, key=lambda c: (c.breakeven_tokens, c.gather_seconds)) if cands else None

    @property
    def exposed_seconds_per_step(self) -> float:
        """Gather time left on the critical path per step: the first gather plus every part of a
        gather that outlasts the previous layer's compute."""
        exposed = self.layers[0].gather_seconds
        for prev, cur in zip(self.layers, self.layers[1:], strict=False):
            exposed += max(0.0, cur.gather_seconds - prev.compute_seconds)
        return exposed

    @property
    def kv_bytes_per_token(self) -> int | None:
        return self.deployment.kv_bytes_per_token or self.model.kv_bytes_per_token

    @property
    def largest_weight_bytes(self) -> int:
        """The largest single weight: the transient of loading one tensor or of one finalize gather."""
        return max(math.prod(shape) * g.dtype.itemsize for layer in self.model.layers for g in layer.groups
                   for _, shape in g.weights)

    def load_peaks(self) -> dict[str, int]:
        """Load-time peaks per GPU (SGLang's weight sharding for Kimi K3: "运行期常驻和加载峰值", the
        resident and the load peak), as upper bounds:

        * ``device_rows``: row-shard loading (BF16/FP16, ModelOpt FP8): the row shards R/N, the two
          slots and one weight in flight -- finalize packs a layer's rows into a slot before it
          allocates the layer's chunk, so rows and chunks never coexist beyond one layer's padding;
        * ``device_requant_then_shard``: block FP8 loads full weights (R), then chunks and slots
          are allocated while they are still there: the peak is *not* reduced, only the resident;
        * ``host``: one rank's shard plus one weight staged on the host.
        """
        b = self.bill
        return {
            "device_rows": b.resident_shard_bytes + b.finalize_slot_bytes + self.largest_weight_bytes,
            "device_requant_then_shard": b.replicated_bytes + b.resident_shard_bytes + b.finalize_slot_bytes,
            "host": b.resident_shard_bytes + self.largest_weight_bytes,
        }

    @property
    def extra_kv_tokens(self) -> int | None:
        kv = self.kv_bytes_per_token
        return None if kv is None else max(0, self.bill.net_saving_bytes) // kv

    @property
    def extra_requests(self) -> int | None:
        ctx = self.deployment.context
        return None if ctx is None or self.extra_kv_tokens is None else self.extra_kv_tokens // ctx

    # ---- what the saving buys: the KV-cache pool, replicated vs sharded -------------------------------
    @property
    def kv_pool_bytes(self) -> int | None:
        """The replicated deployment's KV pool per GPU: the deployment's, else the model's default."""
        v = self.deployment.kv_pool_bytes
        return v if v is not None else self.model.defaults.get("kv_pool_bytes")

    @property
    def context(self) -> int | None:
        """Tokens per sequence when counting concurrent sequences: the deployment's, else the model's default."""
        v = self.deployment.context
        return v if v is not None else self.model.defaults.get("context")

    def kv_capacity(self) -> dict[str, int | None] | None:
        """KV-cache tokens and concurrent sequences (of :attr:`context` tokens) per GPU, replicated vs
        sharded: the sharded pool is the replicated one plus the net saving (SGLang's weight sharding
        for Kimi K3 finalizes before the pool is sized, so everything given back becomes KV cache).
        None without a pool and a KV size per token."""
        kv, pool = self.kv_bytes_per_token, self.kv_pool_bytes
        if kv is None or pool is None:
            return None
        sharded_pool = pool + max(0, self.bill.net_saving_bytes)
        ctx = self.context
        return {
            "pool_bytes_replicated": pool, "pool_bytes_sharded": sharded_pool,
            "tokens_replicated": pool // kv, "tokens_sharded": sharded_pool // kv,
            "context": ctx,
            "sequences_replicated": None if ctx is None else pool // (kv * ctx),
            "sequences_sharded": None if ctx is None else sharded_pool // (kv * ctx),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; bytes are integers, times seconds, bandwidth bytes/s."""
        b, d = self.bill, self.deployment
        return {
            "preset": self.model.name,
            "ranks": b.ranks,
            "layers": b.layers,
            "replicated_bytes": b.replicated_bytes,
            "resident_shard_bytes": b.resident_shard_bytes,
            "slot_bytes": b.slot_bytes,
            "map_own_chunk": b.map_own_chunk,
            "sharded_resident_bytes": b.sharded_resident_bytes,
            "padding_bytes": b.padding_bytes,
            "gross_saving_bytes": b.gross_saving_bytes,
            "shard_saving_bytes": b.shard_saving_bytes,
            "net_saving_bytes": b.net_saving_bytes,
            "largest_layer_bytes": b.largest_layer_bytes,
            "allgather_bytes_per_rank_per_layer": self.largest.gather_bytes_per_rank,
            "allgather_seconds_largest_layer": self.largest.gather_seconds,
            "breakeven_tokens": self.breakeven_tokens,
            "exposed_seconds_per_step": self.exposed_seconds_per_step,
            "tokens": d.tokens,
            "device": d.device.name,
            "bandwidth_bytes_per_s": d.bandwidth,
            "efficiency": d.efficiency,
            "collective_latency_s": d.collective_latency,
            "largest_weight_bytes": self.largest_weight_bytes,
            "load_peak_device_bytes": self.load_peaks()["device_rows"],
            "load_peak_device_requant_then_shard_bytes": self.load_peaks()["device_requant_then_shard"],
            "load_peak_host_bytes": self.load_peaks()["host"],
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "extra_kv_tokens": self.extra_kv_tokens,
            "context": d.context,
            "extra_requests": self.extra_requests,
            "kv_capacity": self.kv_capacity(),
            "groups": [
                {"name": n, "dtype": SUPPORTED_DTYPES[dt], "replicated_bytes": nb} for n, dt, nb in self.groups
            ],
            "per_layer": [
                {
                    "index": c.index,
                    "kind": c.kind,
                    "payload_bytes": c.payload_bytes,
                    "layout_bytes": c.layout_bytes,
                    "gather_bytes_per_rank": c.gather_bytes_per_rank,
                    "gather_seconds": c.gather_seconds,
                    "compute_seconds": c.compute_seconds,
                    "hide_ratio": c.hide_ratio,
                    "breakeven_tokens": c.breakeven_tokens,
                }
                for c in self.layers
            ],
            "assumptions": list(self.model.assumptions),
            "source": self.model.source,
        }


def estimate(model: ModelSpec, deployment: Deployment) -> Plan:
    """Price ``model`` on ``deployment``: the exact memory bill and the per-layer timing model."""
    n = deployment.ranks
    mapped = deployment.map_own_chunk
    layouts = model.layouts(n, MAPPED_PAGE_BYTES if mapped else None)
    bill = bill_for_layouts(layouts, map_own_chunk=mapped)
    costs: list[LayerCost] = []
    prev_per_token: float | None = None
    for layer, lay in zip(model.layers, layouts, strict=True):
        g = gather_seconds(lay.total_bytes, n, deployment.bandwidth, deployment.collective_latency)
        per_token = compute_seconds_per_token(layer, deployment.device, deployment.efficiency)
        compute = per_token * deployment.tokens
        if prev_per_token is None:
            ratio, be = None, None
        else:
            prev_compute = prev_per_token * deployment.tokens
            ratio = g / prev_compute if prev_compute > 0 else (0.0 if g == 0 else math.inf)
            be = breakeven(g, prev_per_token)
        costs.append(LayerCost(
            index=layer.index,
            kind=layer.kind,
            payload_bytes=lay.payload_bytes,
            layout_bytes=lay.total_bytes,
            gather_bytes_per_rank=(n - 1) * lay.chunk_bytes,
            gather_seconds=g,
            params=sum(gr.params for gr in layer.groups),
            compute_seconds_per_token=per_token,
            compute_seconds=compute,
            hide_ratio=ratio,
            breakeven_tokens=be,
        ))
        prev_per_token = per_token
    return Plan(model, deployment, bill, tuple(costs), tuple(model.group_totals()))

