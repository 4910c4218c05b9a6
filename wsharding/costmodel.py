"""The bill of weight sharding, before any GPU runs: memory given back, traffic added, when it hides.

First seed, "代价：通信量与显存账" (the cost: traffic and the memory bill). With R the bytes of the
sharded (otherwise replicated) weights, N ranks in a shard group and ``T_l`` the flat buffer of
sharded layer ``l``:

* memory per GPU: replicated ``R``  ->  sharded ``R/N + 2 * max_l |T_l|`` (two ping-pong slots sized
  by the largest layer). ``|T_l|`` is the *padded* flat buffer of :class:`~wsharding.layout.FlatLayout`
  (16-byte aligned entries, total a multiple of ``16 * N``), so the resident shards are
  ``sum_l |T_l| / N`` -- a few bytes more than ``R/N``.
* the seed reports the **gross** figure ``R`` as "reclaimed" (e.g. 31.45 GiB). What is really
  given back is the **net** saving ``R - sum_l |T_l|/N - 2 * max_l |T_l|``
  ``= (1 - 1/N) * R - 2 * max|T| - padding/N``. Both are reported, and named.
* traffic: a ring AllGather moves ``(N-1)/N * |T_l|`` bytes per rank per layer, whatever the batch.
* time: the gather of layer ``l+1`` runs while layer ``l`` computes. Layer ``l``'s compute time is
  modelled as the GEMMs of its sharded weights only: ``2 * tokens * params / (peak * efficiency)``.
  That is a *lower bound* on the layer's time (routed experts and attention also run and would hide
  more), so the break-even batch reported here is a conservative (pessimistic) one. At small
  batches GEMMs are memory-bound, which also makes them slower than this model: again conservative.
* the net saving turns into KV cache: ``net_saving // kv_bytes_per_token`` more tokens.

Models are described per layer: groups of weights, each either by its weight shapes (exact layout,
one layout entry per weight) or by a byte count (one layout entry for the whole group: the padding
is then that of one entry, which is what a group stored as a single tensor would pay).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from wsharding.errors import WshardingError
from wsharding.layout import SUPPORTED_DTYPES, FlatLayout, LayoutError, parse_dtype
from wsharding.units import GB, GiB, fmt_bytes  # noqa: F401 - re-exported for the notebooks


class CostModelError(WshardingError, ValueError):
    """A model description or deployment that the cost model cannot price; names the bad field."""


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """Peak numbers of one GPU, used only to turn FLOPs and bytes into seconds.

    ``peak_flops`` maps a precision class (``"fp8"`` for 1-byte weights, ``"bf16"`` for 2-byte,
    ``"tf32"`` for 4-byte) to dense tensor-core FLOP/s. ``link_bandwidth`` is the per-direction
    NVLink bandwidth of one GPU in bytes/s: the most a rank can receive during an AllGather.
    """

    name: str
    peak_flops: Mapping[str, float]
    link_bandwidth: float
    hbm_bytes: int
    source: str

    def peak_for(self, dtype: torch.dtype) -> float:
        key = {1: "fp8", 2: "bf16", 4: "tf32"}[dtype.itemsize]
        return self.peak_flops[key]


#: Public datasheet figures (dense, i.e. the "with sparsity" numbers halved). Nominal peaks: real
#: GEMMs reach a fraction of them, which is what ``Deployment.efficiency`` is for.
#: The page of ``map_own_chunk``'s mapped views: CUDA's allocation granularity, 2 MiB on an H200
#: (``cuMemGetAllocationGranularity``, measured; the sharding asks the driver, the cost model assumes it).
MAPPED_PAGE_BYTES = 2 * 2**20

DEVICES: dict[str, Device] = {
    "b200": Device(
        "b200",
        {"fp8": 4.5e15, "bf16": 2.25e15, "tf32": 1.1e15},
        link_bandwidth=900e9,
        hbm_bytes=180 * GB,
        source="NVIDIA HGX/DGX B200 datasheet per GPU: FP8 9 PF and BF16 4.5 PF with sparsity (dense: half), "
        "NVLink 5 1.8 TB/s bidirectional (900 GB/s per direction), 180 GB HBM3e",
    ),
    "h200": Device(
        "h200",
        {"fp8": 1.979e15, "bf16": 0.989e15, "tf32": 0.494e15},
        link_bandwidth=450e9,
        hbm_bytes=141 * GB,
        source="NVIDIA H200 SXM datasheet: FP8 3,958 TF and BF16 1,979 TF with sparsity (dense: half), "
        "NVLink 4 900 GB/s bidirectional (450 GB/s per direction), 141 GB HBM3e",
    ),
}


def get_device(name: str | Device) -> Device:
    """The :class:`Device` preset called ``name`` (``b200``, ``h200``) or ``name`` itself."""
    if isinstance(name, Device):
        return name
    key = str(name).lower()
    if key not in DEVICES:
        raise CostModelError(f"device: unknown device {name!r}; known: {sorted(DEVICES)}")
    return DEVICES[key]


# ---------------------------------------------------------------------------------------------
# Model description
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightGroup:
    """Weights of one layer that belong together in the bill (e.g. attention projections).

    ``weights`` are ``(name, shape)`` pairs, all of ``dtype``; a group given only by a byte count
    is one weight of shape ``(bytes / itemsize,)``.
    """

    name: str
    dtype: torch.dtype
    weights: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.weights)

    @property
    def nbytes(self) -> int:
        return self.params * self.dtype.itemsize

    def specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """Layout entries, named ``group.weight`` (or ``group`` for a byte-count group)."""
        return [(wname if wname == self.name else f"{self.name}.{wname}", shape, self.dtype)
                for wname, shape in self.weights]


@dataclass(frozen=True)
class LayerSpec:
    """One sharded layer: its index in the model, its kind, its groups of sharded weights."""

    index: int
    kind: str
    groups: tuple[WeightGroup, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def layout(self, ranks: int, chunk_alignment: int | None = None) -> FlatLayout:
        """The layer's flat buffer T for a group of ``ranks`` (padding included); ``chunk_alignment``:
        every chunk a whole number of such units (the pages of ``map_own_chunk``)."""
        return FlatLayout([s for g in self.groups for s in g.specs()], ranks, chunk_alignment=chunk_alignment)


@dataclass(frozen=True)
class ModelSpec:
    """The sharded layers of a model plus what the bill needs to speak about them."""

    name: str
    layers: tuple[LayerSpec, ...]
    description: str = ""
    source: str = ""
    assumptions: tuple[str, ...] = ()
    kv_bytes_per_token: int | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def replicated_bytes(self) -> int:
        return sum(layer.payload_bytes for layer in self.layers)

    def layouts(self, ranks: int, chunk_alignment: int | None = None) -> list[FlatLayout]:
        return [layer.layout(ranks, chunk_alignment) for layer in self.layers]

    def group_totals(self) -> list[tuple[str, torch.dtype, int]]:
        """``(group name, dtype, bytes over all layers)`` in first-seen order."""
        totals: dict[tuple[str, torch.dtype], int] = {}
        for layer in self.layers:
            for g in layer.groups:
                totals[(g.name, g.dtype)] = totals.get((g.name, g.dtype), 0) + g.nbytes
        return [(name, dtype, n) for (name, dtype), n in totals.items()]

    def with_dtype(self, dtype: torch.dtype | str) -> ModelSpec:
        """The same weights (same parameter counts and shapes) stored in ``dtype``."""
        dt = _dtype(dtype, "dtype")
        layers = tuple(
            replace(layer, groups=tuple(replace(g, dtype=dt) for g in layer.groups)) for layer in self.layers
        )
        return replace(self, layers=layers)


def _dtype(value: Any, what: str) -> torch.dtype:
    try:
        return parse_dtype(value, what=what)
    except LayoutError as e:
        raise CostModelError(str(e)) from None


def _int(value: Any, what: str, *, minimum: int = 0) -> int:
    # bool is an int in Python; a `true` in a JSON file is a typo, not a size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise CostModelError(f"{what}: expected an integer, got {value!r}")
    if value < minimum:
        raise CostModelError(f"{what}: must be >= {minimum}, got {value}")
    return value


def _split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers that differ by at most one (larger ones first)."""
    base, rem = divmod(total, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


def model_from_dict(d: Mapping[str, Any]) -> ModelSpec:
    """Build a :class:`ModelSpec` from a plain description (the format of ``presets/*.json``).

    Keys: ``name``; ``kinds``: ``{kind: {"groups": [group, ...]}}``; ``sequence``: ``[[kind, count],
    ...]`` repeated ``repeat`` times (default 1) gives the order of the sharded layers;
    optional ``first_layer`` (index of the first sharded layer), ``description``, ``source``,
    ``assumptions`` (list of strings), ``kv_bytes_per_token``, ``defaults`` (``ranks``, ``device``,
    ``tokens``, ``context``). A group is ``{"name", "dtype"}`` plus exactly one of
    ``"bytes"`` (per layer), ``"total_bytes"`` (over every layer of the kind, split as evenly as
    whole elements allow) or ``"weights"``: ``[{"name", "shape"}, ...]`` (per layer).
    """
    if not isinstance(d, Mapping):
        raise CostModelError(f"model: expected a mapping, got {type(d).__name__}")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise CostModelError("name: the model needs a non-empty string name")
    kinds = d.get("kinds")
    if not isinstance(kinds, Mapping) or not kinds:
        raise CostModelError(f"{name}.kinds: expected a non-empty mapping kind -> {{'groups': [...]}}")
    sequence = d.get("sequence")
    if not isinstance(sequence, list) or not sequence:
        raise CostModelError(f"{name}.sequence: expected a non-empty list of [kind, count]")
    repeat = _int(d.get("repeat", 1), f"{name}.repeat", minimum=1)
    first = _int(d.get("first_layer", 0), f"{name}.first_layer")

    order: list[str] = []
    for i, item in enumerate(sequence):
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise CostModelError(f"{name}.sequence[{i}]: expected [kind, count], got {item!r}")
        kind, count = item
        if kind not in kinds:
            raise CostModelError(f"{name}.sequence[{i}]: unknown kind {kind!r}; kinds: {sorted(kinds)}")
        order += [kind] * _int(count, f"{name}.sequence[{i}].count", minimum=1)
    order *= repeat
    counts = {k: order.count(k) for k in kinds}

    # Per kind: for each group, the list of per-layer weight tuples (one per layer of that kind).
    per_kind: dict[str, list[tuple[str, torch.dtype, list[tuple[tuple[str, tuple[int, ...]], ...]]]]] = {}
    for kind, kd in kinds.items():
        where = f"{name}.kinds.{kind}"
        groups = kd.get("groups") if isinstance(kd, Mapping) else None
        if not isinstance(groups, list) or not groups:
            raise CostModelError(f"{where}.groups: expected a non-empty list of groups")
        n_layers = counts[kind]
        parsed = []
        seen: set[str] = set()
        for j, g in enumerate(groups):
            gw = f"{where}.groups[{j}]"
            if not isinstance(g, Mapping):
                raise CostModelError(f"{gw}: expected a mapping, got {g!r}")
            gname = g.get("name")
            if not isinstance(gname, str) or not gname:
                raise CostModelError(f"{gw}.name: expected a non-empty string")
            if gname in seen:
                raise CostModelError(f"{gw}.name: duplicate group {gname!r} in kind {kind!r}")
            seen.add(gname)
            gw = f"{where}.{gname}"
            if "dtype" not in g:
                raise CostModelError(f"{gw}.dtype: missing")
            dt = _dtype(g["dtype"], f"{gw}.dtype")
            given = [k for k in ("bytes", "total_bytes", "weights") if k in g]
            if len(given) != 1:
                raise CostModelError(f"{gw}: give exactly one of bytes, total_bytes, weights (got {given or 'none'})")
            if "weights" in g:
                weights = _parse_weights(g["weights"], f"{gw}.weights")
                per_layer = [weights] * n_layers
            else:
                key = given[0]
                nbytes = _int(g[key], f"{gw}.{key}", minimum=1)
                if nbytes % dt.itemsize:
                    raise CostModelError(f"{gw}.{key}: {nbytes} B is not a whole number of {dt} elements")
                elems = nbytes // dt.itemsize
                if key == "bytes":
                    per_layer_elems = [elems] * n_layers
                else:
                    if n_layers and elems < n_layers:
                        raise CostModelError(f"{gw}.total_bytes: {nbytes} B cannot be split over {n_layers} layers")
                    per_layer_elems = _split(elems, n_layers) if n_layers else []
                per_layer = [((gname, (e,)),) for e in per_layer_elems]
            parsed.append((gname, dt, per_layer))
        per_kind[kind] = parsed

    cursor = {k: 0 for k in kinds}
    layers = []
    for pos, kind in enumerate(order):
        i = cursor[kind]
        cursor[kind] += 1
        groups = tuple(WeightGroup(gname, dt, per_layer[i]) for gname, dt, per_layer in per_kind[kind])
        layers.append(LayerSpec(first + pos, kind, groups))

    kv = d.get("kv_bytes_per_token")
    kv = None if kv is None else _int(kv, f"{name}.kv_bytes_per_token", minimum=1)
    assumptions = d.get("assumptions", [])
    if not isinstance(assumptions, list) or not all(isinstance(a, str) for a in assumptions):
        raise CostModelError(f"{name}.assumptions: expected a list of strings")
    defaults = d.get("defaults", {})
    if not isinstance(defaults, Mapping):
        raise CostModelError(f"{name}.defaults: expected a mapping")
    return ModelSpec(
        name=name,
        layers=tuple(layers),
        description=str(d.get("description", "")),
        source=str(d.get("source", "")),
        assumptions=tuple(assumptions),
        kv_bytes_per_token=kv,
        defaults=dict(defaults),
    )


def _parse_weights(value: Any, where: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    if not isinstance(value, list) or not value:
        raise CostModelError(f"{where}: expected a non-empty list of {{'name', 'shape'}}")
    out = []
    for k, w in enumerate(value):
        if not (isinstance(w, Mapping) and isinstance(w.get("name"), str) and isinstance(w.get("shape"), list)):
            raise CostModelError(f"{where}[{k}]: expected {{'name': str, 'shape': [int, ...]}}, got {w!r}")
        shape = tuple(_int(s, f"{where}.{w['name']}.shape", minimum=1) for s in w["shape"])
        out.append((w["name"], shape))
    return tuple(out)


def load_model_file(path: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a JSON or YAML file in the :func:`model_from_dict` format."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise CostModelError(f"model file {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:  # a binary file (a program, a checkpoint) given by mistake
        raise CostModelError(f"model file {path}: not a JSON/YAML model description (a binary file: byte "
                             f"{e.object[e.start]:#04x} at offset {e.start} is not UTF-8 text); pass a .json or "
                             ".yaml file in the format of costmodel.model_from_dict") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 -- any parse error becomes one clear message
        raise CostModelError(f"model file {path}: not valid {path.suffix.lstrip('.') or 'JSON'} ({e})") from None
    return model_from_dict(data)


# ---------------------------------------------------------------------------------------------
# The memory bill: exact, from layouts
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bill:
    """Bytes per GPU, replicated versus sharded, computed exactly from the layers' flat layouts.

    gross_saving_bytes  = R: the figure the seed calls "reclaimed" (what stops being replicated);
    shard_saving_bytes  = R - sum_l |T_l|/N: what the shards give back (~ (1 - 1/N) R);
    net_saving_bytes    = shard_saving - 2 max_l |T_l|: what is really free for the KV cache.
    """

    ranks: int
    layers: int
    replicated_bytes: int
    resident_shard_bytes: int
    largest_layer_bytes: int
    slot_bytes: int
    padding_bytes: int
    #: The layers gather into views mapped over their chunks ([Note: the own chunk mapped, not
    #: copied]): after finalize a slot keeps only the peers' pages, (N-1)/N of it.
    map_own_chunk: bool = False

    @property
    def finalize_slot_bytes(self) -> int:
        """The two slots while finalize runs: whole, mapped or not (finalize rebuilds weights in them)."""
        return 2 * self.largest_layer_bytes

    @property
    def sharded_resident_bytes(self) -> int:
        return self.resident_shard_bytes + self.slot_bytes

    @property
    def gross_saving_bytes(self) -> int:
        return self.replicated_bytes

    @property
    def shard_saving_bytes(self) -> int:
        return self.replicated_bytes - self.resident_shard_bytes

    @property
    def net_saving_bytes(self) -> int:
        return self.replicated_bytes - self.sharded_resident_bytes


def bill_for_layouts(
    layer_layouts: Sequence[FlatLayout], n_layers_total: int | None = None, ranks: int | None = None,
    map_own_chunk: bool = False,
) -> Bill:
    """The exact memory :class:`Bill` of sharded layers given by their :class:`FlatLayout` s.

    ``layer_layouts``: one layout per sharded layer; if ``n_layers_total`` is larger, the list is
    a repeating pattern cycled up to that many layers (e.g. one layout for 92 identical layers).
    ``ranks`` defaults to the layouts' group size and must match it. Resident shards are the
    chunks (``total_bytes / N`` each), slots are ``2 * max total_bytes``, R counts only payload.
    ``map_own_chunk``: the slots keep ``2 * (N-1) * max chunk_bytes`` after finalize (build the
    layouts with ``chunk_alignment=MAPPED_PAGE_BYTES``, as the sharding does).
    """
    if not layer_layouts:
        raise CostModelError("layer_layouts: need at least one layout")
    sizes = {lay.group_size for lay in layer_layouts}
    if len(sizes) != 1:
        raise CostModelError(f"layer_layouts: group sizes differ ({sorted(sizes)}); one shard group has one N")
    n = sizes.pop()
    if ranks is not None and ranks != n:
        raise CostModelError(f"ranks: {ranks} does not match the layouts' group_size {n}")
    total = len(layer_layouts) if n_layers_total is None else _int(n_layers_total, "n_layers_total", minimum=1)
    if total < len(layer_layouts):
        raise CostModelError(f"n_layers_total: {total} is fewer than the {len(layer_layouts)} layouts given")
    layouts = [layer_layouts[i % len(layer_layouts)] for i in range(total)]
    largest = max(lay.total_bytes for lay in layouts)
    return Bill(
        ranks=n,
        layers=total,
        replicated_bytes=sum(lay.payload_bytes for lay in layouts),
        resident_shard_bytes=sum(lay.chunk_bytes for lay in layouts),
        largest_layer_bytes=largest,
        # Two ping-pong slots, each holding one full layer: sized by the largest layer. Mapped, each
        # keeps the peers' N-1 pieces of the largest chunk (its own piece is every layer's chunk).
        slot_bytes=2 * (n - 1) * max(lay.chunk_bytes for lay in layouts) if map_own_chunk else 2 * largest,
        padding_bytes=sum(lay.total_bytes - lay.payload_bytes for lay in layouts),
        map_own_chunk=map_own_chunk,
    )


# ---------------------------------------------------------------------------------------------
# Deployment and timing
# ---------------------------------------------------------------------------------------------
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
        _int(self.ranks, "ranks", minimum=1)
        _int(self.tokens, "tokens", minimum=0)
        if self.link_bandwidth is not None and not (self.link_bandwidth > 0 and math.isfinite(self.link_bandwidth)):
            raise CostModelError(f"bandwidth: must be a positive number of bytes/s, got {self.link_bandwidth!r}")
        if not 0 < self.efficiency <= 1:
            raise CostModelError(f"efficiency: must be in (0, 1], got {self.efficiency!r}")
        if not self.collective_latency >= 0:
            raise CostModelError(f"latency: must be >= 0 seconds, got {self.collective_latency!r}")
        if self.kv_bytes_per_token is not None:
            _int(self.kv_bytes_per_token, "kv_bytes_per_token", minimum=1)
        if self.context is not None:
            _int(self.context, "context", minimum=1)
        if self.kv_pool_bytes is not None:
            _int(self.kv_pool_bytes, "kv_pool_bytes", minimum=0)

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
        """Load-time peaks per GPU (first seed: "运行期常驻和加载峰值"), as upper bounds:

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
        sharded: the sharded pool is the replicated one plus the net saving (the seed finalizes before
        the pool is sized, so everything given back becomes KV cache). None without a pool and a
        KV size per token."""
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


# ---------------------------------------------------------------------------------------------
# Presentation
# ---------------------------------------------------------------------------------------------
def fmt_seconds(s: float) -> str:
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    return f"{s * 1e3:.3f} ms"


def plan_table(plan: Plan) -> str:
    """A readable multi-line report of a :class:`Plan` (GiB = 2**30 B, GB = 10**9 B)."""
    b, d, m = plan.bill, plan.deployment, plan.model
    L = plan.largest
    lines = [f"wsharding plan: {m.name}" + (f" -- {m.description}" if m.description else "")]
    if m.source:
        lines.append(f"  source: {m.source}")
    for a in m.assumptions:
        lines.append(f"  assumption: {a}")
    lines += [
        f"  shard group N = {b.ranks}, {b.layers} sharded layers, device {d.device.name}, "
        f"link {d.bandwidth / GB:.0f} GB/s per direction, {d.tokens} tokens per step, efficiency {d.efficiency:g}",
        "",
        "replicated weights per GPU, by group:",
    ]
    for name, dt, nb in plan.groups:
        lines.append(f"  {name:<28} {SUPPORTED_DTYPES[dt]:<9} {fmt_bytes(nb)}")
    lines += [
        f"  {'total R':<28} {'':<9} {fmt_bytes(b.replicated_bytes)}",
        "",
        "memory per GPU                 replicated             sharded",
        f"  weights (R | shards sum|T|/N) {b.replicated_bytes / GiB:>10.2f} GiB {b.resident_shard_bytes / GiB:>14.2f} GiB",
        f"  {'mapped slots 2(N-1)/N max|T|' if b.map_own_chunk else 'two slots (2 max|T|)':<30}"
        f"{0:>10.2f} GiB {b.slot_bytes / GiB:>14.2f} GiB",
        f"  total                         {b.replicated_bytes / GiB:>10.2f} GiB {b.sharded_resident_bytes / GiB:>14.2f} GiB",
        "",
        f"  gross saving R (the seed's 'reclaimed'): {fmt_bytes(b.gross_saving_bytes)}",
        f"  shard saving R - sum|T|/N (~(1-1/N)R):   {fmt_bytes(b.shard_saving_bytes)}",
        f"  net saving, after the two slots:         {fmt_bytes(b.net_saving_bytes)}  ({b.net_saving_bytes} B)",
        f"  (layout padding over all layers: {b.padding_bytes} B)",
    ]
    if b.net_saving_bytes <= 0:
        lines.append("  -> sharding does not pay: the two slots cost more than the shards give back")
    lp = plan.load_peaks()
    lines += [
        "",
        "load peaks per GPU (upper bounds; largest single weight " + fmt_bytes(plan.largest_weight_bytes) + "):",
        f"  device, row-shard loading (BF16, ModelOpt FP8): {fmt_bytes(lp['device_rows'])}",
        f"  device, block FP8 requant-then-shard:           {fmt_bytes(lp['device_requant_then_shard'])}"
        "  (not reduced: full weights first)",
        f"  host: one shard + one weight:                   {fmt_bytes(lp['host'])}",
    ]
    lines += [
        "",
        f"traffic and time (largest layer {L.index}, |T| = {fmt_bytes(L.layout_bytes)}):",
        f"  AllGather per rank per layer (N-1)/N |T|: {fmt_bytes(L.gather_bytes_per_rank)}, "
        f"{fmt_seconds(L.gather_seconds)} at {d.bandwidth / GB:.0f} GB/s",
        f"  compute of the sharded GEMMs of that layer at {d.tokens} tokens: {fmt_seconds(L.compute_seconds)}",
    ]
    w = plan.worst_pair
    if w is None:
        lines.append("  one sharded layer only: its gather is issued up front and cannot hide behind another")
    else:
        lines += [
            f"  hardest gather to hide: layer {w.index} ({w.kind}) behind layer {w.index - 1}: "
            f"ratio gather/compute {w.hide_ratio:.2f} at {d.tokens} tokens",
            f"  break-even: every gather hides from {plan.breakeven_tokens} tokens per step "
            "(compute counts only the sharded GEMMs: a conservative bound)",
            f"  exposed gather time per step at {d.tokens} tokens: {fmt_seconds(plan.exposed_seconds_per_step)}",
        ]
    if plan.kv_bytes_per_token:
        lines.append(f"\nKV cache: {plan.kv_bytes_per_token} B per token -> net saving buys {plan.extra_kv_tokens} tokens"
                     + (f" = {plan.extra_requests} requests of {d.context} tokens" if d.context else ""))
    cap = plan.kv_capacity()
    if cap is not None:
        seq = (f"; sequences of {cap['context']} tokens: {cap['sequences_replicated']:,} -> {cap['sequences_sharded']:,}"
               if cap["context"] else "")
        lines.append(f"KV pool per GPU {cap['pool_bytes_replicated'] / GiB:.2f} GiB replicated -> "
                     f"{cap['pool_bytes_sharded'] / GiB:.2f} GiB sharded: tokens {cap['tokens_replicated']:,} -> "
                     f"{cap['tokens_sharded']:,}{seq}")
    return "\n".join(lines)
