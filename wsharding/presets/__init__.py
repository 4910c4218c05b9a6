"""Model presets for the cost model: one JSON file per preset in this folder.

Each file is in the :func:`wsharding.costmodel.model_from_dict` format and says where its numbers
come from (``source``) and what it had to assume (``assumptions``).
"""

from __future__ import annotations

import json
from importlib import resources

from wsharding.costmodel import CostModelError, ModelSpec, model_from_dict


def list_presets() -> list[str]:
    """Names of the presets shipped with the package."""
    return sorted(p.name[: -len(".json")] for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def preset_dict(name: str) -> dict:
    """The raw description of preset ``name`` (a fresh copy: safe to edit into a custom model)."""
    if name not in list_presets():
        raise CostModelError(f"preset: unknown preset {name!r}; known: {', '.join(list_presets())}")
    return json.loads(resources.files(__name__).joinpath(f"{name}.json").read_text())


def load_preset(name: str) -> ModelSpec:
    """The :class:`~wsharding.costmodel.ModelSpec` of preset ``name``."""
    return model_from_dict(preset_dict(name))
