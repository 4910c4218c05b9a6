"""Quant methods by name: how configs, presets and the CLI choose one."""

from __future__ import annotations

from collections.abc import Callable

from wsharding.linear.fp8 import BlockFp8LinearMethod, Fp8PerTensorLinearMethod
from wsharding.linear.quant import (
    BlockInt8LinearMethod,
    Int8PerChannelLinearMethod,
    LinearMethodBase,
    PackedInt4LinearMethod,
    QuantError,
    UnquantizedLinearMethod,
)

#: name -> factory. "fp8" is ModelOpt FP8 per-tensor; "fp8_block" is block FP8 with the UE8M0 requant.
METHODS: dict[str, Callable[[], LinearMethodBase]] = {
    "none": UnquantizedLinearMethod,
    "int8": Int8PerChannelLinearMethod,
    "int8_block": BlockInt8LinearMethod,
    "int4_packed": PackedInt4LinearMethod,
    "fp8": Fp8PerTensorLinearMethod,
    "fp8_block": BlockFp8LinearMethod,
}


def make_quant_method(name: str | None, **kwargs) -> LinearMethodBase | None:
    """A fresh quant method for ``name`` (``None`` or ``"none"``: unquantized, returned as None so that
    the linear builds its default)."""
    if name is None or name == "none":
        return None
    if name not in METHODS:
        raise QuantError(f"quant: unknown quant method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name](**kwargs)
