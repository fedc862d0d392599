#!/usr/bin/env bash
# Create .venv if needed, install torch==2.13.0 (the version the tests are checked with; the package itself asks
# only torch>=2.4) and lavo with its test extras (pytest, and triton: the tests run its kernels in Triton's CPU
# interpreter), run the default test suite.
# The tests run in parallel, one process a core up to four (pytest-xdist; `-n 0` runs them in this process).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow -n 0` for the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test]"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --numprocesses auto --maxprocesses 4 "$@"
