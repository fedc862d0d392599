#!/usr/bin/env bash
# Install torch==2.13.0 and lavo into .venv (scripts/venv.sh: skipped when they are installed already), and run
# the demo:
# tiny LAVO vs tiny softmax+RoPE on Jane Austen, perplexity at 1x..8x the training length (runs/demo/).
# Extra arguments go to `lavo demo`, e.g. `bash scripts/demo.sh --set train.steps=100`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
install_lavo ""
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1  # logs appear as they happen, even piped
say "starting the demo"
exec .venv/bin/lavo demo "$@"
