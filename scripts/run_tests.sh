#!/usr/bin/env bash
# Install (if needed) and run the whole test suite on CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest "$@"
