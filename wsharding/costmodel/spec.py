"""The model description the cost model prices, and the JSON/YAML files that write one down.

Models are described per layer: groups of weights, each either by its weight shapes (exact layout,
one layout entry per weight) or by a byte count (one layout entry for the whole group: the padding
is then that of one entry, which is what a group stored as a single tensor would pay). Parsing
checks every field and names the bad one, so a typo in a model file says where it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from wsharding.core.layout import FlatLayout
from wsharding.costmodel.checks import CostModelError, require_dtype, require_int
from wsharding.io_checks import read_regular_file


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
        dt = require_dtype(dtype, "dtype")
        layers = tuple(
            replace(layer, groups=tuple(replace(g, dtype=dt) for g in layer.groups)) for layer in self.layers
        )
        return replace(self, layers=layers)


def _split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers that differ by at most one (larger ones first)."""
    base, rem = divmod(total, parts)
    return [base + (1 if i < rem else 0) for i in range(parts)]


#: The most sharded layers a model file may describe: each is listed and priced one by one, so a
#: count of 10**18 (a typo) would otherwise fill the memory instead of saying so.
MAX_LAYERS = 100_000
#: The whole-number fields of a model's ``defaults`` and their least values.
DEFAULT_INTS = {"ranks": 1, "tokens": 0, "context": 1, "kv_pool_bytes": 0}


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
    repeat = require_int(d.get("repeat", 1), f"{name}.repeat", minimum=1, maximum=MAX_LAYERS)
    first = require_int(d.get("first_layer", 0), f"{name}.first_layer")

    order: list[str] = []
    for i, item in enumerate(sequence):
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            raise CostModelError(f"{name}.sequence[{i}]: expected [kind, count], got {item!r}")
        kind, count = item
        if kind not in kinds:
            raise CostModelError(f"{name}.sequence[{i}]: unknown kind {kind!r}; kinds: {sorted(kinds)}")
        order += [kind] * require_int(count, f"{name}.sequence[{i}].count", minimum=1, maximum=MAX_LAYERS)
    if len(order) * repeat > MAX_LAYERS:  # every layer is listed and priced one by one
        raise CostModelError(f"{name}.sequence: {len(order)} layers x repeat {repeat} = {len(order) * repeat} layers, "
                             f"more than the {MAX_LAYERS} a model file may describe; check the counts")
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
            dt = require_dtype(g["dtype"], f"{gw}.dtype")
            given = [k for k in ("bytes", "total_bytes", "weights") if k in g]
            if len(given) != 1:
                raise CostModelError(f"{gw}: give exactly one of bytes, total_bytes, weights (got {given or 'none'})")
            if "weights" in g:
                weights = _parse_weights(g["weights"], f"{gw}.weights")
                per_layer = [weights] * n_layers
            else:
                key = given[0]
                nbytes = require_int(g[key], f"{gw}.{key}", minimum=1)
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
    kv = None if kv is None else require_int(kv, f"{name}.kv_bytes_per_token", minimum=1)
    assumptions = d.get("assumptions", [])
    if not isinstance(assumptions, list) or not all(isinstance(a, str) for a in assumptions):
        raise CostModelError(f"{name}.assumptions: expected a list of strings")
    defaults = d.get("defaults", {})
    if not isinstance(defaults, Mapping):
        raise CostModelError(f"{name}.defaults: expected a mapping")
    # read later as numbers (int(d["ranks"]) took "ranks: eight" as a ValueError and 2.5 as 2): checked
    # here, where the file's field can still be named
    for key, low in DEFAULT_INTS.items():
        if defaults.get(key) is not None:
            require_int(defaults[key], f"{name}.defaults.{key}", minimum=low)
    if defaults.get("device") is not None and not isinstance(defaults["device"], str):
        raise CostModelError(f"{name}.defaults.device: expected a device name (b200, h200), got {defaults['device']!r}")
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
        shape = tuple(require_int(s, f"{where}.{w['name']}.shape", minimum=1) for s in w["shape"])
        out.append((w["name"], shape))
    return tuple(out)


#: The largest model file read. A description lists a few kinds of layers and their weights (the
#: presets are a few KB); the limit keeps a file given by mistake -- or made to be expensive -- from
#: being parsed whole (pure-Python YAML parses about a MB a second).
MAX_MODEL_FILE_BYTES = 1 << 20
#: The most values (every mapping key and value, every list item) a YAML model file may expand to.
#: YAML aliases repeat a node without repeating its text: nine aliases nine deep (a "billion laughs")
#: are a few hundred bytes that expand to 9**9 values, which model_from_dict would walk (and repr, in
#: its messages) one by one; an alias of a node inside itself never ends.
MAX_MODEL_VALUES = 100_000
_MODEL_TODO = "pass a .json or .yaml file in the format of costmodel.model_from_dict"


def load_model_file(path: str | Path) -> ModelSpec:
    """A :class:`ModelSpec` from a JSON or YAML file in the :func:`model_from_dict` format.

    The file is untrusted input: a regular file of at most :data:`MAX_MODEL_FILE_BYTES`, checked
    before it is opened (a FIFO or a device given as ``--model`` hung or was killed for memory), read
    as YAML with ``yaml.safe_load`` (no Python objects) and refused when its aliases expand it past
    :data:`MAX_MODEL_VALUES` values.
    """
    path = Path(path)
    raw = read_regular_file(path, "model file", max_bytes=MAX_MODEL_FILE_BYTES, todo=_MODEL_TODO,
                            error=CostModelError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # a binary file (a program, a checkpoint) given by mistake
        raise CostModelError(f"model file {path}: not a JSON/YAML model description (a binary file: byte "
                             f"{e.object[e.start]:#04x} at offset {e.start} is not UTF-8 text); {_MODEL_TODO}") from None
    yaml_file = path.suffix.lower() in (".yaml", ".yml")
    if not yaml_file and path.suffix.lower() != ".json":
        # read by its suffix: README.md read as JSON said "not valid md", as if md were a model format
        raise CostModelError(f"model file {path}: a model description is a .json, .yaml or .yml file, not "
                             f"{path.suffix or 'a file without a suffix'}; {_MODEL_TODO}")
    try:
        if yaml_file:
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 -- any parse error becomes one clear message
        raise CostModelError(f"model file {path}: not valid {path.suffix.lstrip('.') or 'JSON'} ({e})") from None
    if yaml_file and not _within_values(data, MAX_MODEL_VALUES):
        raise CostModelError(f"model file {path}: its YAML aliases (*name) expand it to more than {MAX_MODEL_VALUES} "
                             "values (an alias repeats a whole node; nested, they multiply, and one inside its own "
                             f"anchor never ends); write the repeated parts out, or use the sequence's counts; "
                             f"{_MODEL_TODO}")
    return model_from_dict(data)


def _within_values(data: Any, budget: int) -> bool:
    """Whether ``data`` -- as a reader walking it sees it, every alias expanded -- holds at most
    ``budget`` values. Stops as soon as the count passes ``budget``: the cost is bounded by it, not by
    what the aliases expand to (nor by a cycle)."""
    stack, seen = [data], 1
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        # Counted as they are pushed, not as they are popped: the stack never holds more than the
        # budget (a list aliased into itself would otherwise push its whole length on every visit).
        seen += len(children)
        if seen > budget:
            return False
        stack.extend(children)
    return True


