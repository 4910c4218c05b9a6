"""The course's calculator: one deployment priced by the cost model, a stage of rows per notebook.

Notebook 00 builds it and reads the bill (memory, traffic, break-even, KV tokens); every later notebook
adds the rows its stage teaches -- the flat layout's padding, the gather's traffic, the slots of a deeper
lookahead, the load peaks, which weights count, shard groups, the KV pool, decode -- and prints the
calculator so far with :meth:`Calculator.table`. Every number comes from
:func:`~wsharding.costmodel.estimate` (the ``wsharding plan`` command's bill) or from
:func:`~wsharding.costmodel.bill_for_layouts` on the same layouts: nothing is computed twice.

    calc = Calculator.design()                # the design's deployment: Kimi K3 FP8 on 8 B200s
    print(calc.table("03"))                   # the rows of notebooks 00 to 03
    Calculator.design(ranks=4, tokens=1024)   # the same model on another deployment
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from wsharding.core.errors import NotFound
from wsharding.core.units import GB, fmt_bytes
from wsharding.costmodel import Deployment, ModelSpec, Plan, bill_for_layouts, estimate, fmt_seconds, get_device
from wsharding.costmodel.devices import MAPPED_PAGE_BYTES
from wsharding.lab.args.plan import DEFAULT_PRESET
from wsharding.presets import load_preset


@dataclass(frozen=True)
class Row:
    """One number of the calculator: the notebook whose stage adds it, what it is, its exact value
    (bytes and tokens are integers, times seconds) and how it is computed."""

    stage: str
    name: str
    value: int | float | None
    unit: str
    formula: str

    def text(self) -> str:
        if self.value is None:
            shown = "-"
        elif self.unit == "B":
            shown = fmt_bytes(self.value).split(" (")[0]  # GiB or MiB; the exact bytes are in ``value``
        elif self.unit == "s":
            shown = fmt_seconds(self.value)
        else:
            shown = f"{self.value:,} {self.unit}"
        return f"{self.stage}  {self.name:<36} {shown:>17}   {self.formula}"


#: notebook -> what its stage adds to the calculator
STAGES: dict[str, str] = {
    "00": "the bill",
    "01": "the flat layout",
    "02": "the gather",
    "03": "lookahead and slots",
    "04": "loading",
    "05": "which weights count",
    "06": "shard groups",
    "07": "serving",
    "08": "decode",
}


class Calculator:
    """One model on one deployment, priced once (:attr:`plan`); :meth:`stage` gives a notebook's rows."""

    def __init__(self, model: ModelSpec, deployment: Deployment) -> None:
        self.model = model
        self.deployment = deployment
        self.plan: Plan = estimate(model, deployment)

    @classmethod
    def design(cls, preset: str = DEFAULT_PRESET, **deployment: Any) -> Calculator:
        """The deployment a preset states (for the default, the design's: Kimi K3 decode, FP8, on 8 B200s,
        256 tokens per step, requests of 8192 tokens, a 40 GiB KV pool when replicated), with any field of
        :class:`~wsharding.costmodel.Deployment` changed (``device`` may be a name: ``"h200"``)."""
        model = load_preset(preset)
        d = model.defaults
        kw: dict[str, Any] = {"ranks": d.get("ranks", 8), "device": d.get("device", "b200"),
                              "tokens": d.get("tokens", 256), "context": d.get("context"),
                              "kv_pool_bytes": d.get("kv_pool_bytes")}
        kw.update(deployment)
        if isinstance(kw["device"], str):
            kw["device"] = get_device(kw["device"])
        return cls(model, Deployment(**kw))

    def with_(self, **deployment: Any) -> Calculator:
        """The same model on a deployment with these fields changed."""
        return Calculator(self.model, replace(self.deployment, **deployment))

    def stage(self, notebook: str) -> list[Row]:
        """The rows notebook ``notebook`` (``"00"`` .. ``"08"``) adds."""
        if notebook not in STAGES:
            raise NotFound(f"notebook {notebook!r}: the calculator has stages {', '.join(STAGES)}")
        return _STAGE_ROWS[notebook](self)

    def so_far(self, notebook: str) -> list[Row]:
        """Every row from notebook 00 up to and including ``notebook``."""
        self.stage(notebook)  # refuses an unknown notebook
        return [row for nb in STAGES if nb <= notebook for row in self.stage(nb)]

    def value(self, notebook: str, name: str) -> int | float | None:
        """The value of the row ``name`` of ``notebook``'s stage."""
        for row in self.stage(notebook):
            if row.name == name:
                return row.value
        raise NotFound(f"notebook {notebook}: no row {name!r}")

    def table(self, notebook: str) -> str:
        """The calculator so far as text: a title line, then one line per row."""
        d = self.deployment
        title = (f"the calculator, notebooks 00-{notebook}: {self.model.name} on {d.ranks} x {d.device.name.upper()} "
                 f"({d.bandwidth / GB:g} GB/s), {d.tokens:,} tokens per step")
        return "\n".join([title, *(row.text() for row in self.so_far(notebook))])

    def __repr__(self) -> str:
        d = self.deployment
        return f"Calculator({self.model.name}, {d.ranks} x {d.device.name}, {d.tokens} tokens per step)"


# ---- the rows of each stage ------------------------------------------------------------------------------
def _bill(c: Calculator) -> list[Row]:
    p, b = c.plan, c.plan.bill
    return [
        Row("00", "replicated weights per GPU (R)", b.replicated_bytes, "B", "R"),
        Row("00", "sharded: chunks + two slots", b.sharded_resident_bytes, "B", "sum|T_l|/N + 2 max|T_l|"),
        Row("00", "net saving per GPU", b.net_saving_bytes, "B", "R - sharded"),
        Row("00", "gathered per rank, largest layer", p.largest.gather_bytes_per_rank, "B", "(N-1)/N max|T_l|"),
        Row("00", "break-even tokens per step", p.breakeven_tokens, "tokens", "every gather <= the layer before"),
        Row("00", "KV tokens the net saving buys", p.extra_kv_tokens, "tokens", "net / KV bytes per token"),
    ]


def _layout(c: Calculator) -> list[Row]:
    p, b = c.plan, c.plan.bill
    return [
        Row("01", "padding of the flat layouts", b.padding_bytes, "B", "sum (|T_l| - payload_l)"),
        Row("01", "chunk per rank, largest layer", p.largest.layout_bytes // b.ranks, "B", "max|T_l| / N"),
    ]


def _gather(c: Calculator) -> list[Row]:
    p = c.plan
    return [
        Row("02", "received per rank per step", sum(x.gather_bytes_per_rank for x in p.layers), "B",
            "sum (N-1)/N |T_l|"),
        Row("02", "every gather of a step, back to back", sum(x.gather_seconds for x in p.layers), "s",
            "sum (N-1)/N |T_l| / B"),
    ]


def _lookahead(c: Calculator) -> list[Row]:
    p = c.plan
    layouts = c.model.layouts(c.deployment.ranks, MAPPED_PAGE_BYTES if c.deployment.map_own_chunk else None)
    three = bill_for_layouts(layouts, map_own_chunk=c.deployment.map_own_chunk, slots=3)
    return [
        Row("03", "exposed gather per step, lookahead 1", p.exposed_seconds_per_step, "s",
            "first + what outlasts the layer before"),
        Row("03", "slots at lookahead depth 2", three.slot_bytes, "B", "3 max|T_l|"),
    ]


def _loading(c: Calculator) -> list[Row]:
    peaks = c.plan.load_peaks()
    return [
        Row("04", "load peak, rows read per rank", peaks["device_rows"], "B", "sum|T_l|/N + slots + one weight"),
        Row("04", "load peak, requantized whole first", peaks["device_requant_then_shard"], "B",
            "R + sum|T_l|/N + slots"),
    ]


def _weights(c: Calculator) -> list[Row]:
    return [Row("05", f"{name} (replicated linears)", nbytes, "B", "tp 1: whole on every GPU, in R")
            for name, _, nbytes in c.plan.groups]


def _groups(c: Calculator) -> list[Row]:
    n = c.deployment.ranks
    half = n // 2
    if half < 1 or n % 2:
        return [Row("06", "net saving, shard groups of N/2", None, "B", "N is odd: no two equal groups")]
    return [Row("06", f"net saving, shard groups of {half}", c.with_(ranks=half).plan.bill.net_saving_bytes, "B",
                "R - (sum|T_l|/g + 2 max|T_l|)")]


def _serving(c: Calculator) -> list[Row]:
    cap = c.plan.kv_capacity()
    if cap is None:
        return [Row("07", "KV pool tokens", None, "tokens", "needs a KV pool and KV bytes per token")]
    ctx = cap["context"]
    rows = [
        Row("07", "KV tokens per GPU, replicated", cap["tokens_replicated"], "tokens", "pool / KV bytes per token"),
        Row("07", "KV tokens per GPU, sharded", cap["tokens_sharded"], "tokens", "(pool + net) / KV bytes per token"),
    ]
    if ctx is not None:
        rows.append(Row("07", f"more requests of {ctx:,} tokens",
                        cap["sequences_sharded"] - cap["sequences_replicated"], "requests", "whole requests, per GPU"))
    return rows


def _decode(c: Calculator) -> list[Row]:
    one = c.with_(tokens=1).plan
    half_link = c.with_(link_bandwidth=c.deployment.bandwidth / 2).plan
    return [
        Row("08", "exposed gather per step at 1 token", one.exposed_seconds_per_step, "s", "decode: little to hide behind"),
        Row("08", "break-even tokens, link at half speed", half_link.breakeven_tokens, "tokens",
            "a busy link: twice the gather"),
    ]


_STAGE_ROWS: dict[str, Callable[[Calculator], list[Row]]] = {
    "00": _bill, "01": _layout, "02": _gather, "03": _lookahead, "04": _loading, "05": _weights, "06": _groups,
    "07": _serving, "08": _decode,
}
