#!/usr/bin/env bash
# Install torch==2.13.0 and lavo with its test extras (pytest, and triton: the tests run its kernels in Triton's
# CPU interpreter) into .venv (scripts/venv.sh: skipped when they are installed already), and run the default test
# suite.
# The tests run in parallel, one process a core up to four (pytest-xdist; `-n 0` runs them in this process).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow -n 0` for the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
install_lavo test
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --numprocesses auto --maxprocesses 4 "$@"
