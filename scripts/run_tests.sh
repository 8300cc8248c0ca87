#!/usr/bin/env bash
# Install (if needed) and run the whole test suite on CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
# With no arguments, the whole suite on two worker processes (pytest-xdist), each test file
# whole on one worker: many tests spend their time waiting (on a watchdog's timeout, a server,
# a restarted job), and the other worker uses that time. PYTEST_WORKERS=0 runs it in one process.
if [ $# -eq 0 ]; then
  exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile
fi
exec .venv/bin/python -m pytest "$@"
