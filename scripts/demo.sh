#!/usr/bin/env bash
# Create .venv if needed, install torch==2.13.0 (the version the README's numbers come from; the package itself
# asks only torch>=2.4) and lavo, and run the demo:
# tiny LAVO vs tiny softmax+RoPE on Jane Austen, perplexity at 1x..8x the training length (runs/demo/).
# Extra arguments go to `lavo demo`, e.g. `bash scripts/demo.sh --set train.steps=100`.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[$(date +%H:%M:%S)] $*"; }
if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    python3 -m venv .venv
fi
say "installing torch==2.13.0 into .venv (the first time, this downloads it: minutes)"
.venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
say "installing lavo and its dependencies"
.venv/bin/pip install --quiet --disable-pip-version-check -e .
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1  # logs appear as they happen, even piped
say "starting the demo"
exec .venv/bin/lavo demo "$@"
