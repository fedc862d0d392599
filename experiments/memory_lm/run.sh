#!/usr/bin/env bash
# The memory variants as language models on Austen (experiment 1's model, budget and window), then three probes
# of the trained models: perplexity at 1x..16x the training length, context use (the same last 256 tokens given
# 0..16K tokens before them), and passkey retrieval after brief fine-tuning. Core 1, one thread.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
export PYTHONPATH="$ROOT"  # this checkout's lavo, not an installed one
PIN="taskset -c 1"
E=experiments/memory_lm
DATA="data.data_dir=${DATA_DIR:-data}"
lavo_run() {  # lavo_run NAME [attention option=value ...]
  local name="$1"; shift
  local options=(--set model.attention=lavo --set model.attention_options.window=32)
  for option in "$@"; do options+=(--set "model.attention_options.$option"); done
  train_run $E "$name" --set "$DATA" "${options[@]}"
}
lavo_run lavo
lavo_run lavo-decay write=decay
lavo_run lavo-gated write=gated
lavo_run lavo-vector memory=vector
lavo_run lavo-gated-vector write=gated memory=vector read_temperature=true
train_run $E local --set "$DATA" --set model.attention=local --set model.attention_options.window=32
train_run $E softmax-rope --set "$DATA" --set model.attention=softmax --set model.position=rope
RUNS=($E/runs/lavo $E/runs/lavo-decay $E/runs/lavo-gated $E/runs/lavo-vector $E/runs/lavo-gated-vector
      $E/runs/local $E/runs/softmax-rope)
eval_runs $E all --lengths 256,512,1024,2048,4096 --max-tokens 24576 --batch-size 16 --chunk-size 1024 -- "${RUNS[@]}"
python experiments/report_tools.py results $E
probe() {  # probe NAME SCRIPT RUN_DIRS_AND_ARGS...: skipped when NAME/results.json exists
  local name="$1" script="$2"; shift 2
  if [ -f "$E/$name/results.json" ]; then echo "[skip] $E/$name"; return 0; fi
  mkdir -p "$E/$name"
  timed "$E" "probe $name" "$E/$name/$(basename "$script" .py).log" python "$script" "$@" --out "$E/$name"
}
# The held-out split has 131,148 tokens: 7 spans of 16,384 + 257 tokens fit; the first run was 16 spans with
# contexts 0..4,096 (context_use-4k).
probe context_use-4k experiments/context_use/context_use.py "${RUNS[@]}" --contexts 0,256,1024,4096 --segments 16
probe context_use experiments/context_use/context_use.py "${RUNS[@]}" --contexts 0,256,1024,4096,16384 --segments 7
# Fine-tuning for 60 steps (the first run), then 400.
probe passkey-60steps experiments/passkey/passkey.py "${RUNS[@]}" --multiples 1,4,16 --steps 60 --samples 16
probe passkey experiments/passkey/passkey.py "${RUNS[@]}" --multiples 1,4,16 --steps 400 --samples 16
# Longer fine-tuning at 1x..64x, every model.
probe passkey-1000steps experiments/passkey/passkey.py "${RUNS[@]}" --multiples 1,4,16,32,64 --steps 1000 --samples 16
python experiments/memory_lm/report.py $E
