#!/usr/bin/env bash
# The GPU check of LAVO's Triton path (benchmarks/gpu_check.py): kernel tests on CUDA, op benchmark against SDPA
# (and fla's ops when importable), decoding, whole-model training and a profile by kernel, all bf16, in under six
# minutes on an H200 (the steps share 330 s; `--budget SECONDS` changes it).
# Runs from this source tree (no install, no network) with the python3 on PATH or $PYTHON; results and logs go to
# OUT_DIR, the summary to OUT_DIR/<gpu>_bf16.{json,md}. `--dry-run` checks the script on the CPU at tiny sizes;
# `--wheels DIR` (a path from the repository root) puts the pure-Python wheels in DIR on the path, e.g. fla-core's.
# Usage: bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--wheels DIR] [--budget SECONDS]
set -euo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [--dry-run] [--wheels DIR] [--budget SECONDS]}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$out" "$@"
