#!/usr/bin/env bash
# Behaviour check across a change: train three tiny models (lavo, softmax+RoPE, s4d) for 40 steps with the source
# tree SRC and score them at 256/512/1024 tokens, writing OUT/eval/results.json. Run it on a checkout before and
# after a refactor and compare the two results.json files; the same seed must give the same perplexities.
#   bash scripts/retrain_check.sh SRC OUT [DATA_DIR]
set -euo pipefail
SRC=$(cd "$1" && pwd); OUT=$2; DATA=${3:-data}
PY=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
export PYTHONPATH=$SRC OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
CONFIG=$SRC/experiments/lm_extrapolation/base.json
train() {
  local name=$1; shift
  "$PY" -m lavo.cli train --config "$CONFIG" --set train.steps=40 --set train.checkpoint_interval=0 \
    --set data.data_dir="$DATA" --set train.out_dir="$OUT/$name" --overwrite "$@"
}
train lavo --set model.attention=lavo --set model.attention_options.window=32
train softmax-rope --set model.attention=softmax --set model.position=rope
train s4d --set model.attention=s4d
"$PY" -m lavo.cli eval "$OUT/lavo" "$OUT/softmax-rope" "$OUT/s4d" --lengths 256,512,1024 --max-tokens 4096 \
  --device cpu --quiet --out "$OUT/eval"
