"""The bill of weight sharding, before any GPU runs: memory given back, traffic added, when it hides.

From SGLang's weight sharding for Kimi K3, "代价：通信量与显存账" (the cost: traffic and the memory
bill). With R the bytes of the sharded (otherwise replicated) weights, N ranks in a shard group and
``T_l`` the flat buffer of sharded layer ``l``:

* memory per GPU: replicated ``R``  ->  sharded ``R/N + 2 * max_l |T_l|`` (two ping-pong slots sized
  by the largest layer). ``|T_l|`` is the *padded* flat buffer of :class:`~wsharding.core.layout.FlatLayout`
  (16-byte aligned entries, total a multiple of ``16 * N``), so the resident shards are
  ``sum_l |T_l| / N`` -- a few bytes more than ``R/N``.
* the design reports the **gross** figure ``R`` as "reclaimed" (e.g. 31.45 GiB). What is really
  given back is the **net** saving ``R - sum_l |T_l|/N - 2 * max_l |T_l|``
  ``= (1 - 1/N) * R - 2 * max|T| - padding/N``. Both are reported, and named.
* traffic: a ring AllGather moves ``(N-1)/N * |T_l|`` bytes per rank per layer, whatever the batch.
* time: the gather of layer ``l+1`` runs while layer ``l`` computes. Layer ``l``'s compute time is
  modelled as the GEMMs of its sharded weights only: ``2 * tokens * params / (peak * efficiency)``.
  That is a *lower bound* on the layer's time (routed experts and attention also run and would hide
  more), so the break-even batch reported here is a conservative (pessimistic) one. At small
  batches GEMMs are memory-bound, which also makes them slower than this model: again conservative.
* the net saving turns into KV cache: ``net_saving // kv_bytes_per_token`` more tokens.

The parts, one concern each: :mod:`~wsharding.costmodel.devices` (GPU presets),
:mod:`~wsharding.costmodel.spec` (the model description and its JSON/YAML files),
:mod:`~wsharding.costmodel.bill` (the memory bill: the one resident formula, which the sharding
calls too), :mod:`~wsharding.costmodel.plan` (deployment, timing, the whole plan) and
:mod:`~wsharding.costmodel.report` (the text report). Every public name is re-exported here, so
``from wsharding.costmodel import X`` works for all of them.
"""

from __future__ import annotations

from wsharding.core.units import GB, GiB, fmt_bytes  # re-exported for the notebooks
from wsharding.costmodel.bill import Bill, bill_for_layouts
from wsharding.costmodel.checks import CostModelError
from wsharding.costmodel.devices import DEVICES, MAPPED_PAGE_BYTES, Device, get_device
from wsharding.costmodel.plan import (
    Deployment,
    LayerCost,
    Plan,
    breakeven,
    compute_seconds_per_token,
    estimate,
    gather_seconds,
)
from wsharding.costmodel.report import fmt_seconds, plan_table
from wsharding.costmodel.spec import LayerSpec, ModelSpec, WeightGroup, load_model_file, model_from_dict

__all__ = [
    "DEVICES",
    "GB",
    "MAPPED_PAGE_BYTES",
    "Bill",
    "CostModelError",
    "Deployment",
    "Device",
    "GiB",
    "LayerCost",
    "LayerSpec",
    "ModelSpec",
    "Plan",
    "WeightGroup",
    "bill_for_layouts",
    "breakeven",
    "compute_seconds_per_token",
    "estimate",
    "fmt_bytes",
    "fmt_seconds",
    "gather_seconds",
    "get_device",
    "load_model_file",
    "model_from_dict",
    "plan_table",
]
