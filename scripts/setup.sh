#!/usr/bin/env bash
# Sets up .venv with wsharding installed in editable mode. A user of the library alone needs only
# `pip install .` (torch, safetensors, numpy); the extras are listed in pyproject.toml.
#   bash scripts/setup.sh          the library and every extra: NCCL wheel, command-line figures, notebooks, HF
#   bash scripts/setup.sh --test   the same + test tools (pytest, nbval, ruff, playwright, coverage)
# The venv sees the system's packages, so a machine that already has torch (a GPU box with its own
# CUDA build) keeps it; where there is none, the CPU wheel torch==2.13.0 is installed. Seeing the
# system's packages can hide a dependency missing from pyproject.toml: scripts/smoke.sh (run by
# .ci/run) installs the package into an isolated venv to catch that.
# The browser test also needs Debian's chromium and fonts-noto-cjk (.ci/run installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
extras=all
[ "${1:-}" = "--test" ] && extras=test
torch_pin=()
.venv/bin/python -c "import torch" 2>/dev/null || torch_pin=("torch==2.13.0")
.venv/bin/python -m pip install -q --disable-pip-version-check "${torch_pin[@]}" -e ".[${extras}]"
# The NCCL wheel our communicator loads must match torch's CUDA major version (the nccl extra declares
# the cu12 one); a CUDA 13 torch gets the cu13 wheel, which wsharding then tries first.
cuda_major=$(.venv/bin/python -c "import torch; print((torch.version.cuda or '').split('.')[0])")
if [ "$cuda_major" = "13" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "nvidia-nccl-cu13>=2.30"
fi

