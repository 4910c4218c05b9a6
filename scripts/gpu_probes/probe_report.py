"""The probes' one way to report: print the JSON, and keep it as ``$OUT/NAME`` when ``OUT`` is set (the
GPU machine returns what a command leaves there)."""

from __future__ import annotations

import json
import os
from typing import Any


def report(name: str, result: Any) -> None:
    print(json.dumps(result, indent=1))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(result, f, indent=1)
