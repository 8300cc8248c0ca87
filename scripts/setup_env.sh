#!/usr/bin/env bash
# Create .venv (if missing) and install megatron_smp with its test dependencies.
# On a machine without a GPU the CPU build of torch 2.13.0 is pinned first, so nothing pulls a
# multi-GB CUDA build; on a GPU machine the torch already present (or the default) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/pip install -q torch 2>&1 | grep -v "^WARNING: Location" || true
  else
    .venv/bin/pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  fi
fi
.venv/bin/pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import megatron_smp, torch; print('megatron_smp ready, torch', torch.__version__)"
